"""The warm start (``empo2 sft``, :mod:`empo2.sft`, :mod:`empo2.rundir.warm_start`): its rows are the prompts a rollout
renders and the gold actions as a rollout's response, its loss covers the response tokens only (checked against a float64
reference), it falls; a run starts from it (the start policy and the KL reference are the warm-started policy, the
config records its checksum) and refuses one made for another model, or one that changed since.

Real parts throughout: the WebShop fixture's environment (in this process, or its real worker processes through the
CLI), a 2-layer random Llama with SmolLM2's tokenizer (the ``tiny_model`` fixture), PEFT's LoRA, real run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from empo2.agent.prompts import PromptParts, hints_text, render_prompt_ids
from empo2.config import Config, ConfigError
from empo2.envs.actions import replayable_gold
from empo2.envs.factory import make_env_kwargs
from empo2.envs.webshop.env import WebShopEnv
from empo2.experiments.arm_runs import arm_overrides
from empo2.policy.loader import load_model
from empo2.policy.logprobs import response_logprobs
from empo2.rundir import warm_start
from empo2.rundir.manifest import verify_manifest
from empo2.sft import SFTTrainer
from empo2.sft.demos import Demos, interleave

QUICK = ["env.max_steps=6", "train.report_to=none", "train.progress=false", "policy.max_completion_length=24"]


def sft_config(model: str, *overrides: str) -> Config:
    return Config.load("configs/webshop_cpu.yaml", [f"policy.model={model}", *QUICK, *overrides])


def webshop(cfg: Config):
    """An environment factory: the fixture WebShop in this process."""
    return lambda: WebShopEnv(**make_env_kwargs(cfg.env))


def make_warm_start(model: str, folder: Path, *overrides: str) -> dict:
    cfg = sft_config(model, "sft.demos=2", "sft.epochs=1", "sft.validation_demos=0", "sft.eval_variations=0",
                     *overrides)
    model_, tok = load_model(model, "cpu", "float32")
    with SFTTrainer(cfg, model_, tok, env=webshop(cfg), output_dir=folder) as sft:
        return sft.train()


def other_tiny_model(folder: Path, seed: int, hidden: int = 64) -> str:
    """A random 2-layer Llama like the ``tiny_model`` fixture, with its own weights (and optionally width)."""
    from empo2.policy.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# ----------------------------------------------------------------------------------------------------- the rows
@pytest.mark.slow
def test_warm_start_targets_are_exactly_the_gold_actions_and_its_loss_falls(tiny_model, tmp_path):
    """Three gold episodes of the fixture, three epochs: every row's prompt is what the rollout renders (steps 0 and 1
    rebuilt here from the environment with the prompt builder), its target is the gold action's tokens and the
    end-of-sequence token, the loss is the NLL of those tokens only (a float64 reference over the target positions of
    prompt + target), the training loss falls epoch by epoch, and the warm start holds the adapter trained."""
    cfg = sft_config(tiny_model, "sft.demos=3", "sft.epochs=3", "sft.learning_rate=3e-3", "sft.validation_demos=2",
                     "sft.eval_variations=1", "sft.batch_rows=4")
    model, tok = load_model(tiny_model, "cpu", "float32")
    with SFTTrainer(cfg, model, tok, env=webshop(cfg), output_dir=tmp_path / "sft") as sft:
        lora_before = {n: p.detach().clone() for n, p in sft.model.named_parameters() if p.requires_grad}
        best = sft.train()
        rows, episodes = sft.demos.rows, sft.demos.episodes

        env = WebShopEnv(**make_env_kwargs(cfg.env))
        eos = tok.eos_token_id
        assert len(episodes) == 3 and sft.demos.skipped == []
        for index, (task, variation, steps) in enumerate(episodes):
            obs, info = env.reset(task, variation)
            gold = replayable_gold(env.gold_actions())
            mine = [r for r in rows if r.episode == index]
            assert [r.variation for r in mine] == [variation] * steps and len(gold) == steps
            for row, action in zip(mine, gold):
                assert row.target == tok.encode(action, add_special_tokens=False) + [eos]  # the response, nothing more
                assert tok.decode(row.target) == action + tok.eos_token
                assert tok.decode(row.prompt).endswith("<|im_start|>assistant\n")  # a prompt ends where a reply begins
            demo = env.demonstration(task, variation, cfg.policy.few_shot)
            parts = PromptParts(env="webshop", task=env.task_description(), observation=obs, initial_observation=obs,
                                demonstration=demo, hints=hints_text(info))
            window, longest = cfg.policy.history_window, cfg.policy.max_prompt_length
            assert mine[0].prompt == render_prompt_ids(tok, parts, window, longest)
            after = env.step(gold[0])
            parts.history.append((gold[0], after.observation))
            parts.observation = after.observation
            assert mine[1].prompt == render_prompt_ids(tok, parts, window, longest)

        # the loss: NLL over the target tokens only, against a float64 reference on prompt + target
        sft.validation = Demos(rows[:5], [], [])
        reference_nll, reference_tokens = 0.0, 0
        with torch.no_grad():
            for row in rows[:5]:
                ids = torch.tensor([row.prompt + row.target])
                logp = sft.model(input_ids=ids).logits[0].double().log_softmax(-1)  # [L, V]
                at = torch.arange(len(row.prompt) - 1, len(row.prompt) + len(row.target) - 1)  # predict the targets
                reference_nll -= float(logp[at, torch.tensor(row.target)].sum())
                reference_tokens += len(row.target)
        assert sft.validation_loss() == pytest.approx(reference_nll / reference_tokens, rel=1e-5)

    lines = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train_loss"] for r in lines[1:]]
    assert train_losses[0] > train_losses[1] > train_losses[2]
    assert lines[0]["validation_loss"] > min(r["validation_loss"] for r in lines[1:])
    assert all(r["eval"]["episodes"] == 1 and 0 <= r["eval"]["raw_valid_rate"] <= 1 for r in lines[1:])
    assert all(r["target_tokens"] == sum(len(row.target) for row in rows) for r in lines[1:])
    assert {n for n, p in sft.model.named_parameters() if p.requires_grad
            and not torch.equal(p.detach(), lora_before[n])} == set(lora_before)  # every LoRA weight trained

    made = warm_start.read(tmp_path / "sft")
    assert verify_manifest(made.folder) and made.sha256 == best["sha256"] and made.meta["epoch"] == best["epoch"]
    assert made.meta["base"] == warm_start.base_record(tiny_model, load_model(tiny_model, "cpu", "float32")[0], tok)
    assert (tmp_path / "sft" / "checkpoints" / "iter_000003" / "manifest.json").is_file()


def test_demonstrations_take_the_tasks_in_turn():
    assert interleave({"a": [1, 2, 3], "b": [7]}) == [("a", 1), ("b", 7), ("a", 2), ("a", 3)]


# --------------------------------------------------------------------------------------------------- RL from it
@pytest.mark.slow
def test_a_run_starts_from_the_warm_start(tiny_model, tmp_path):
    """The trainer's policy before its first update and its KL reference (the run's adapter disabled) are the
    warm-started policy (the base model with the warm start's adapter), not the base model; the run's config records
    the warm start's checksum."""
    from peft import PeftModel

    from empo2 import Trainer

    made = make_warm_start(tiny_model, tmp_path / "sft", "sft.learning_rate=1e-2")
    cfg = sft_config(tiny_model, f"policy.warm_start={tmp_path / 'sft'}", "algo.name=grpo", "train.iterations=1",
                     "algo.num_generations=2", "algo.beta=0.1")
    base, tok = load_model(tiny_model, "cpu", "float32")
    warm = PeftModel.from_pretrained(load_model(tiny_model, "cpu", "float32")[0],
                                     str(tmp_path / "sft" / "warm_start" / "adapter"))
    prompt, target = [tok.encode("Task: buy a lotion. Your next action:")], [tok.encode("search[lotion]") + [2]]

    def logp(model):
        with torch.no_grad():
            return response_logprobs(model, prompt, target, tok.pad_token_id)[0]

    with Trainer(cfg, env=webshop(cfg)) as trainer:
        assert trainer.cfg.policy.warm_start_sha256 == made["sha256"]
        torch.testing.assert_close(logp(trainer.model), logp(warm), rtol=1e-5, atol=1e-5)
        with trainer.update._reference():
            torch.testing.assert_close(logp(trainer.model), logp(warm), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logp(trainer.model), logp(base), atol=1e-3)


@pytest.mark.slow
def test_a_warm_start_made_for_another_model_is_refused_with_one_line(tiny_model, tmp_path, capsys):
    """A warm start made for the tiny model, named by a run of another model: one ``error:`` line and exit 2. Another
    architecture is refused before the run folder exists; the same architecture with other weights once they load,
    before the run writes its config."""
    from empo2.cli import main

    make_warm_start(tiny_model, tmp_path / "sft")
    for other, why in ((other_tiny_model(tmp_path / "wide", 1, hidden=32), "model architecture"),
                       (other_tiny_model(tmp_path / "same", 1), "model's weights")):
        run = tmp_path / f"run-{Path(other).name}"
        capsys.readouterr()  # what making the models printed
        assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "grpo", f"policy.model={other}",
                     f"policy.warm_start={tmp_path / 'sft'}", f"train.output_dir={run}", *QUICK]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: policy.warm_start:")
        assert f"was made for another {why} (made for {tiny_model}" in err
        assert not (run / "config.yaml").exists()
    assert not (tmp_path / "run-wide").exists()  # refused before anything was written


@pytest.mark.slow
def test_a_warm_start_that_changed_under_a_run_is_refused(tiny_model, tmp_path, capsys):
    """``train`` records the warm start's checksum in config.yaml; after the warm start is made again, ``--resume``
    is refused with one line, and a damaged warm start is refused as such."""
    from empo2.cli import main

    make_warm_start(tiny_model, tmp_path / "sft")
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "grpo", f"policy.model={tiny_model}",
                 f"policy.warm_start={tmp_path / 'sft'}", f"train.output_dir={run}", "train.iterations=1",
                 "algo.num_generations=2", "env.eval_variations=1", *QUICK]) == 0
    capsys.readouterr()
    recorded = Config.load(run / "config.yaml").policy
    assert recorded.warm_start_sha256 == warm_start.read(tmp_path / "sft").sha256
    # the vLLM engine would load the base model's files: refused with one line before --overwrite empties the run
    kept = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "grpo", f"policy.model={tiny_model}",
                 f"policy.warm_start={tmp_path / 'sft'}", f"train.output_dir={run}", "policy.backend=vllm",
                 "--overwrite", *QUICK]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not run with policy.backend=vllm" in err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == kept

    make_warm_start(tiny_model, tmp_path / "sft", "sft.learning_rate=1e-2", "sft.seed=1")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has changed since this run or preset recorded it" in err

    adapter = tmp_path / "sft" / "warm_start" / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ConfigError, match="is damaged"):
        warm_start.read(tmp_path / "sft")


@pytest.mark.slow
def test_a_preset_that_names_its_own_warm_start_makes_it_from_the_model(tiny_model, tmp_path):
    """One preset for ``sft`` and then ``train`` names the warm start it makes; the sft run's own config names none,
    so that playing or exporting that folder applies its adapter once, not the warm start's under it again."""
    cfg = sft_config(tiny_model, f"policy.warm_start={tmp_path / 'sft'}", "sft.demos=1", "sft.epochs=1",
                     "sft.validation_demos=0", "sft.eval_variations=0")
    model, tok = load_model(tiny_model, "cpu", "float32")
    with SFTTrainer(cfg, model, tok, env=webshop(cfg), output_dir=tmp_path / "sft") as sft:
        assert (sft.cfg.policy.warm_start, sft.cfg.policy.warm_start_sha256) == (None, None)
        assert sft.cfg.sft.output_dir == str(tmp_path / "sft") and cfg.policy.warm_start == str(tmp_path / "sft")


def test_warm_start_arms_need_a_warm_start():
    for arm in ("warm-start", "sft-grpo"):
        with pytest.raises(ConfigError, match=f"algo.arm={arm} starts from a warm start"):
            Config.load(None, arm_overrides(arm))


def test_sft_refuses_what_it_cannot_make(tmp_path, capsys):
    from empo2.cli import main

    for override, message in (("policy.lora=false", "empo2 sft trains a LoRA adapter"),
                              ("policy.warm_start=somewhere", "but policy.warm_start names somewhere")):
        assert main(["sft", "--config", "configs/webshop_cpu.yaml", override,
                     f"sft.output_dir={tmp_path / 'x'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err
        assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_compare_runs_the_warm_start_alone_and_sft_then_grpo(tiny_model, tmp_path):
    """``compare --algos warm-start,sft-grpo`` from one warm start: both runs finish; the warm start alone never
    updates (no optimizer step; its run's adapter is still the fresh one, B = 0, so it plays the warm-started policy);
    both start from the
    same policy, so the second run reuses the first one's start evaluation; the runs record the warm start's checksum."""
    from empo2.cli import main

    made = make_warm_start(tiny_model, tmp_path / "sft")
    out = tmp_path / "cmp"
    assert main(["compare", "--allow-unreachable", "--config", "configs/webshop_cpu.yaml", "--algos",
                 "warm-start,sft-grpo", "--seeds", "0", "--out", str(out), f"policy.model={tiny_model}",
                 f"policy.warm_start={tmp_path / 'sft'}", "env.max_steps=2", "env.eval_variations=1",
                 "algo.num_generations=2", "train.iterations=1", "policy.max_completion_length=6",
                 "train.progress=false", "train.report_to=none"]) == 0
    frozen, grpo = out / "runs" / "warm-start-seed0", out / "runs" / "sft-grpo-seed0"
    for run in (frozen, grpo):
        assert Config.load(run / "config.yaml").policy.warm_start_sha256 == made["sha256"]
    assert all(not t.any() for name, t in ckpt_weights(frozen).items() if "lora_B" in name)
    losses = {run.name: json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"] for run in (frozen, grpo)}
    assert losses[frozen.name] == {} and losses[grpo.name]["optimizer_steps"] >= 1  # GRPO stepped; the frozen arm never
    assert json.loads((grpo / "eval" / "start.json").read_text())["reused_from"] == "warm-start-seed0"


def ckpt_weights(run: Path) -> dict:
    from empo2.rundir import checkpoint as ckpt

    return ckpt.read_weights(ckpt.latest_checkpoint(run), lora=True)


def test_a_raw_output_is_valid_only_when_the_environment_ran_it_as_written():
    from empo2.episodes.episode import Step

    def step(raw, action, accepted=True):
        return Step([1], [1], [2], [0.0], raw, action, "obs", 0.0, "state", accepted=accepted)

    assert step("go to  Kitchen", "go to kitchen").raw_valid  # case and spacing are the cleaner's, not a correction
    assert not step("pick a refilling cup", "pick up cup").raw_valid  # the corrector chose the action
    assert not step("go to kitchen", "go to kitchen", accepted=False).raw_valid  # rejected as written
