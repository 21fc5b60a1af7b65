"""Sharded training (``train.sharding: fsdp``, FSDP2) on CPU: 2 gloo ranks launched by torchrun against one plain
process, a sharded checkpoint resumed on another number of ranks, and ``empo2 export``.

Real pieces throughout: torchrun, gloo collectives, FSDP2's ``fully_shard``, ``torch.distributed.checkpoint``, the
tiny random Llama of ``conftest.tiny_model`` through the repo's loader, ScienceWorld JVMs for the trainer runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from empo2.cli import main
from empo2.config import Config, ConfigError
from empo2.memory.store import TipMemory
from helpers.processes import kill_tree

WORKER = str(Path(__file__).parent / "helpers" / "sharding_worker.py")
TRAIN_ARGS = ["--config", "configs/scienceworld_cpu.yaml", "env.tasks=[find-animal]", "env.max_steps=2",
              "env.eval_variations=1", "algo.num_generations=2", "train.tasks_per_batch=2", "policy.few_shot=0",
              "policy.max_completion_length=8", "policy.reflection_max_tokens=16", "train.progress=false",
              "train.report_to=none", "algo.intrinsic_weight=1.0", "algo.p_memory=1.0", "algo.p_off_policy=0.5",
              "policy.seeded_sampling=true", "train.keep_checkpoints=5", "algo.low_prob_threshold=0.0",
              "train.sharding=fsdp"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path("src").resolve())}


def _run(cmd: list[str], timeout: float = 600) -> str:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]


def _update(tmp: Path, model: str, ranks: int, mode: str, lora: bool, *overrides: str) -> tuple[dict, list]:
    out = tmp / f"{mode}-{ranks}"
    args = [WORKER, model, str(out), mode, "1" if lora else "0", *overrides]
    _run(_torchrun(*args) if ranks == 2 else [sys.executable, *args])
    return load_file(str(out / "weights.safetensors")), json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-kl"])
def test_two_fsdp_ranks_update_as_one_process(tmp_path, tiny_model, lora):
    """Two optimizer steps on the same batch: FSDP over 2 ranks (rank 0 has 4 rows, rank 1 2 rows of zero advantage,
    so rank 1 runs idle passes) against the unsharded single process. float32 throughout (policy.autocast=none), so
    the only difference is the order of float32 sums: gradients summed per rank then reduce-scattered instead of
    accumulated in one process (relative error ~1e-7; the worker's AdamW eps keeps near-zero gradients from
    magnifying it). A weight moves by up to lr = 1e-3 a step; a difference of 1e-6 (0.1 % of a step) would be a
    wrong gradient, not rounding (FSDP's default mean over ranks instead of the sum fails it)."""
    common = ["policy.autocast=none", "train.learning_rate=1e-3", "train.micro_batch_tokens=12",
              "algo.low_prob_threshold=0.0"]
    if lora:  # the KL term's reference forwards run on both ranks too (the adapter disabled)
        common += ["algo.beta=0.05"]
    plain, m_plain = _update(tmp_path, tiny_model, 1, "none", lora, *common)
    sharded, m_sharded = _update(tmp_path, tiny_model, 2, "fsdp", lora, *common)
    base = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert set(sharded) == set(plain)
    moved = 0
    for name, w in plain.items():
        torch.testing.assert_close(sharded[name], w, rtol=0, atol=1e-6, msg=name)
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        moved += int(key in base and (w - base[key]).abs().max() > 1e-4)
    assert moved > 0 or lora  # full fine-tuning moved the base weights
    if lora:
        assert any(w.abs().max() > 0 for n, w in sharded.items() if "lora_B" in n)  # the adapter learned
    for a, b in zip(m_plain, m_sharded):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    assert m_plain[0]["optimizer_steps"] == 1 and m_plain[0]["rows"] == 6


def test_fsdp_config_checks():
    """An overlapped reflection is refused at load under FSDP (one line, exit 2 via ConfigError); a vLLM backend is
    not (its sync gathers the sharded weights: tests/test_sharding_sync.py)."""
    Config.load(None, ["train.sharding=fsdp", "policy.backend=vllm"]).validate()
    with pytest.raises(ConfigError, match="overlap"):
        Config.load(None, ["train.sharding=fsdp", "memory.overlap_reflection=true"]).validate()
    with pytest.raises(ConfigError, match="sharding"):
        Config.load(None, ["train.sharding=zero3"]).validate()
    Config.load(None, ["train.sharding=fsdp"]).validate()


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_one_rank_and_exports(tmp_path, tiny_model):
    """A 2-rank FSDP run is killed (SIGKILL, launcher and ranks) once its first sharded checkpoint is written; a
    1-rank resume continues it (DCP reshards 2 → 1) with its memory; ``empo2 export`` writes weights that
    ``from_pretrained`` loads, and their logits equal the trained sharded model's."""
    run = tmp_path / "run"
    common = [*TRAIN_ARGS, f"policy.model={tiny_model}", f"train.output_dir={run}"]
    first = run / "checkpoints" / "iter_000000"  # renamed into place whole: once it exists it is complete
    _kill_when(_torchrun("-m", "empo2.cli", "train", *common, "train.iterations=3"), first)
    assert (first / "sharded" / ".metadata").is_file() and not (first / "model").exists()
    assert sorted(p.name for p in (first / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    tips_before = _tips(run / "memory.sqlite")
    assert tips_before

    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 0  # this process: one rank
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]  # continued, nothing repeated or lost
    assert tips_before < _tips(run / "memory.sqlite")  # the memory came back and grew
    second = run / "checkpoints" / "iter_000001"
    assert sorted(p.name for p in (second / "sharded").glob("*.distcp")) == ["__0_0.distcp"]

    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    assert main(["export", str(run), str(out)]) == 2  # not over an existing model
    _check_export(out, second, run, tiny_model)


def _kill_when(cmd: list[str], folder: Path, timeout: float = 600) -> None:
    """Start ``cmd`` and SIGKILL it with all its children (torchrun puts its ranks in sessions of their own) once
    ``folder`` exists."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not folder.is_dir():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-4000:] if proc.poll() else "slow"
        time.sleep(0.1)
    kill_tree(proc.pid)
    proc.wait()


def _tips(db: Path) -> set[int]:
    with TipMemory(db) as memory:
        return {t.id for t in memory.all_tips()}


def _check_export(out: Path, checkpoint: Path, run: Path, tiny_model: str) -> None:
    """The exported model's logits equal those of the checkpoint's adapter on the base model (merged by hand)."""
    from peft import set_peft_model_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from empo2.rundir.export import with_adapter

    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    cfg = Config.load(run / "config.yaml")
    reference = with_adapter(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), cfg.policy)
    dcp_to_torch_save(str(checkpoint / "sharded"), str(out.parent / "flat.pt"))  # DCP's own reader, one file
    adapter = torch.load(out.parent / "flat.pt", weights_only=True)["model"]
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # it trained
    set_peft_model_state_dict(reference, {k.replace(".default", ""): v for k, v in adapter.items()})
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        want = reference.eval()(input_ids=ids).logits.double()
        got = exported(input_ids=ids).logits.double()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (want - base.double()).abs().max() > 1e-6  # the adapter changes the logits: the check below can fail
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # merged W + BA vs W x + B(A x): float32 rounding
