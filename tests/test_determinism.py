"""A run reproduces from its seed: what one seed, one thread count, one CPU kernel path and one set of library versions
fix (docs/fidelity.md, "What a seed fixes").

Real parts throughout: the real ScienceWorld simulator (its JVMs in worker processes, ``env.pool=process``, or in this
process through an environment factory, the local pool), the tiny random Llama of tests/conftest.py (SmolLM2's
tokenizer) loaded by the real loader with LoRA, the real MiniLM embedder and SQLite memory. EMPO² with memory and
novelty, so that every kind of draw is taken: tasks and modes, sampled tokens, retrieval, reflection, the update.
``env.pool=ray`` is left out until the Ray pool builds (it is another pool of the same protocol; add it to POOLS).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from empo2 import Config, Trainer, machine
from empo2.envs.factory import make_env_kwargs
from empo2.envs.specs import get_env_spec
from empo2.memory.embedder import get_embedder
from empo2.memory.store import TipMemory

pytestmark = pytest.mark.slow  # real simulators, whole runs

POOLS = ["process", "local"]
SMALL = ["env.tasks=[find-animal]", "env.train_variations=2", "env.eval_variations=2", "env.max_steps=3",
         "algo.name=empo2", "algo.num_generations=2", "algo.p_memory=1.0", "algo.p_off_policy=0.5",
         "algo.intrinsic_weight=1.0", "algo.novelty_threshold=1.0", "train.iterations=2", "train.tasks_per_batch=1",
         "policy.few_shot=1", "policy.max_completion_length=8", "policy.reflection_max_tokens=12",
         "train.progress=false", "train.report_to=none",
         "algo.low_prob_threshold=0",  # a random model gives each token p ≈ 1/vocab, which the default δ masks
         "train.learning_rate=0.01"]  # the first update moves the policy that iteration 1 samples from
UNTIMED = ("time", "tokens_per_s", "memory_peak_rss_gb")
"""Metrics keys that measure the machine's speed, not the run."""


def train_run(folder: Path, tiny_model: str, pool: str, *overrides: str) -> dict:
    """Train a run of :data:`SMALL` in this process into ``folder``; everything it computed."""
    cfg = Config.load("configs/scienceworld_cpu.yaml", [f"policy.model={tiny_model}", *SMALL, *overrides])
    factory = partial(get_env_spec(cfg.env.name).factory, **make_env_kwargs(cfg.env)) if pool == "local" else None
    with Trainer(cfg, env=factory, output_dir=folder) as trainer:
        trainer.train()
    return everything(folder)


def everything(run: Path) -> dict:
    """Every score, loss, tip, evaluation and weight a run folder holds (timings left out)."""
    metrics = [{k: v for k, v in json.loads(line).items() if k not in UNTIMED}
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    with TipMemory(run / "memory.sqlite") as memory:
        tips = [{k: v for k, v in t.to_dict().items() if k != "created_at"} for t in memory.all_tips()]
    evals = {p.stem: json.loads(p.read_text()) for p in sorted((run / "eval").glob("*.json"))}
    samples = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    weights = load_file(str(last / "model" / "adapter_model.safetensors"))
    return {"metrics": metrics, "tips": tips, "evals": evals, "samples": samples, "weights": weights}


def assert_same(a: dict, b: dict) -> None:
    for part in ("metrics", "tips", "evals", "samples"):
        assert a[part] == b[part], part
    assert a["weights"].keys() == b["weights"].keys()
    assert [n for n in a["weights"] if not torch.equal(a["weights"][n], b["weights"][n])] == []


@pytest.mark.parametrize("pool", POOLS)
def test_one_seed_trains_the_same_run_twice(tmp_path, tiny_model, pool):
    """Two iterations with a start evaluation, one in between and a final one, trained twice with one seed in one
    process (as a notebook trains twice): every score, loss, tip, sample, evaluation and LoRA weight is equal, bit
    for bit. The first run loads the embedder and the second finds it loaded: what a process did before a run
    (an earlier run, a cached model) does not change its draws."""
    get_embedder.cache_clear()  # the first run loads it, as a fresh process does
    first = train_run(tmp_path / "first", tiny_model, pool, "train.eval_at_start=true", "train.eval_every=1")
    second = train_run(tmp_path / "second", tiny_model, pool, "train.eval_at_start=true", "train.eval_every=1")
    assert [r["iteration"] for r in first["metrics"]] == [0, 1] and first["tips"]
    assert set(first["evals"]) == {"start", "iter_000000", "final"}
    assert any(r["loss"]["optimizer_steps"] for r in first["metrics"])
    assert any(t.abs().max() > 0 for n, t in first["weights"].items() if "lora_B" in n)  # iteration 1 sampled a moved policy
    assert_same(first, second)


def test_evaluations_do_not_change_the_training(tmp_path, tiny_model):
    """A run with a start evaluation and one after iteration 0 trains exactly what the run without them trains (the
    same tasks, tokens, tips with the same step stamps, losses and weights), and its final evaluation is the same: an
    evaluation draws from streams of its own and its steps are not the run's."""
    with_evals = train_run(tmp_path / "evals", tiny_model, "process", "train.eval_at_start=true", "train.eval_every=1")
    without = train_run(tmp_path / "none", tiny_model, "process", "train.eval_at_start=false", "train.eval_every=0")
    assert set(with_evals["evals"]) == {"start", "iter_000000", "final"} and set(without["evals"]) == {"final"}
    for row in with_evals["metrics"]:
        row.pop("eval", None)  # the evaluation's own summary, which the run without it lacks
    with_evals["evals"] = {"final": with_evals["evals"]["final"]}
    assert_same(with_evals, without)


def test_the_start_evaluation_is_the_same_for_every_algorithm(tmp_path, tiny_model, monkeypatch):
    """``compare`` plays a seed's start evaluation once and copies it into that seed's other arms; that is sound
    only if the untrained model's evaluation does not depend on the algorithm or on what the process built before.
    GRPO built after EMPO² (memory, a loaded embedder) evaluates the same episodes, token for token (every token
    the policy generates is recorded on its way out of the real generation call: a random model's text maps to few
    valid actions, so equal actions alone would prove little)."""
    from empo2.episodes import rollout

    generated: list[list[int]] = []

    def recorded(*args, **kwargs):
        out = generate_batch(*args, **kwargs)
        generated.extend(g.ids for g in out)
        return out

    generate_batch = rollout.generate_batch
    monkeypatch.setattr(rollout, "generate_batch", recorded)
    get_embedder.cache_clear()
    starts, tokens = {}, {}
    for algo in ("empo2", "grpo"):
        cfg = Config.load("configs/scienceworld_cpu.yaml", [f"policy.model={tiny_model}", *SMALL, f"algo.name={algo}"])
        generated.clear()
        with Trainer(cfg, output_dir=tmp_path / algo) as trainer:
            starts[algo] = trainer.evaluate(tag="start")
        tokens[algo] = list(generated)
    assert starts["empo2"]["episodes"] == starts["grpo"]["episodes"]
    assert len(starts["grpo"]["episodes"]) == 2 and all(e["actions"] for e in starts["grpo"]["episodes"])
    assert tokens["empo2"] == tokens["grpo"] and len(tokens["grpo"]) >= 2


def test_the_machine_record_names_what_fixes_a_runs_numbers():
    """``machine.jsonl`` holds the thread count, the CPU kernel path torch dispatches to and the library versions;
    runs that differ in one of them are named, key by key."""
    import transformers

    me = machine.describe()
    assert me["torch_threads"] == torch.get_num_threads()
    assert me["kernel"] == torch.backends.cpu.get_cpu_capability()
    assert me["torch"] == torch.__version__ and me["transformers"] == transformers.__version__
    assert set(machine.FIXES) <= set(me)
    other = {**me, "kernel": "AVX2" if me["kernel"] != "AVX2" else "AVX512", "torch_threads": me["torch_threads"] + 1}
    assert machine.differences({"a": [me], "b": [me]}) == []
    assert machine.differences({"a": [me], "b": [other]}) == [
        f"torch_threads {me['torch_threads']} (a) vs {other['torch_threads']} (b)",
        f"kernel {me['kernel']} (a) vs {other['kernel']} (b)"]
    assert machine.differences({"a": [me, other]}) != []  # resumed under another setting
    old = {k: v for k, v in me.items() if k not in ("kernel", "transformers")}  # recorded before these were
    assert machine.differences({"a": [me], "b": [old]}) == []


def test_compare_warns_when_a_seeds_runs_computed_under_other_settings():
    """``compare`` pairs arms by seed: a seed whose runs differ in threads, kernel path or versions (a comparison
    continued with another ``--jobs``, on another machine, after an upgrade) gets a warning in summary.md."""
    from empo2.experiments.compare_summary import machine_warnings

    me = machine.describe()
    other = {**me, "torch_threads": me["torch_threads"] + 1}
    runs = [{"seed": 1, "name": "empo2-seed1", "machines": [me]}, {"seed": 1, "name": "grpo-seed1", "machines": [other]},
            {"seed": 2, "name": "empo2-seed2", "machines": [me]}, {"seed": 2, "name": "grpo-seed2", "machines": [me]}]
    assert machine_warnings(runs) == [
        f"**Warning: seed 1's runs did not compute alike** (torch_threads {me['torch_threads']} (empo2-seed1) vs "
        f"{other['torch_threads']} (grpo-seed1)): with one seed, runs sample the same only under the same threads, "
        "kernels and versions, so the paired differences of this seed also hold the machines' difference."]


def test_a_scienceworld_worker_does_not_remember_its_earlier_episodes():
    """The same episode in a fresh worker and in a worker that played other episodes first (an evaluation, say) reads
    the same: the same observations and the same valid actions in the same order. Under the JVM's default identity
    hashes the simulator named the paint cups' referents differently after other episodes, so the action corrector
    could pick another action, and the training after an evaluation parted from the training without it."""
    from empo2.envs.scienceworld import ScienceWorldEnv

    task = "find-animal"
    seen = []
    for history in (False, True):
        with ScienceWorldEnv() as env:
            if history:
                for variation in env.variations(task, "dev")[:2]:
                    env.reset(task, variation)
                    for action in ("look around", "go to hallway", "look around"):
                        env.step(action)
            obs, _ = env.reset(task, env.variations(task, "train")[0])
            step = env.step("go to art studio")
            seen.append((obs, step.observation, step.info["state"], env.valid_actions()))
    assert seen[0] == seen[1]
    assert any("paint" in action for action in seen[0][3])  # the room whose referents used to change
