#!/usr/bin/env bash
# One prepared GPU check (one CUDA GPU, the repo, its wheels and vllm installed: pip install -e '.[dev,vllm]').
#   bash scripts/gpu_check.sh            # ~5-10 min on one H100/H200
# 1. the rollout-backend contract tests against HF and vLLM, and the real-engine tests (tests/test_vllm_engine.py:
#    tokens, log-probs, weight syncs, a 2-iteration run with π_old recomputed); a vLLM SKIP here is a failure;
# 2. a 2-iteration EMPO² run of the default model with each backend, printing generation tokens/s of HF vs vLLM;
# 3. benchmarks/engines.py: start-up, env-steps/s and whole iterations of HF fp32, HF auto (bf16) and vLLM;
# 4. FSDP (train.sharding=fsdp): the sharding tests on NCCL, then a 2-iteration full fine-tuning run on every GPU
#    (one GPU: a group of one) and `empo2 export` of its sharded checkpoint, loaded back by transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/empo2-gpu-check}
mkdir -p "$OUT"

"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA GPU'; print('torch', torch.__version__, \
'vllm', vllm.__version__, torch.cuda.get_device_name(0))"

echo "== backend contract (hf + vllm)"
"$PY" -m pytest -q -rs tests/test_backend.py -p no:cacheprovider | tee "$OUT/contract.txt"
if grep -q "NOT tested" "$OUT/contract.txt"; then echo "FAIL: vLLM cases were skipped"; exit 1; fi
echo "== real vLLM engine"
"$PY" -m pytest -q -rs -s tests/test_vllm_engine.py -p no:cacheprovider | tee "$OUT/engine.txt"
if grep -q "NOT tested" "$OUT/engine.txt"; then echo "FAIL: vLLM engine cases were skipped"; exit 1; fi

RUN=(--config configs/scienceworld_cpu.yaml train.iterations=2 train.tasks_per_batch=4 algo.num_generations=8
     env.max_steps=10 policy.device=cuda policy.dtype=float32 policy.autocast=bfloat16 train.progress=false
     train.eval_every=0 env.eval_variations=1 train.tensorboard=false)
for backend in hf vllm; do
  echo "== 2-iteration EMPO² run, policy.backend=$backend"
  "$PY" -m empo2.cli train --overwrite "${RUN[@]}" policy.backend=$backend train.output_dir="$OUT/run_$backend" \
    > "$OUT/run_$backend.log" 2>&1 || { tail -40 "$OUT/run_$backend.log"; exit 1; }
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
speed = {}
for backend in ("hf", "vllm"):
    rows = [json.loads(l) for l in (out / f"run_{backend}" / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["tokens_per_s"]["generate"] * r["time"]["generate"] for r in rows)
    seconds = sum(r["time"]["generate"] for r in rows)
    speed[backend] = tokens / max(seconds, 1e-9)
    print(f"{backend:>4}: {tokens:.0f} generated tokens in {seconds:.1f} s = {speed[backend]:.0f} tokens/s; "
          f"train score {[round(r['train']['score_mean'], 1) for r in rows]}")
print(f"vLLM / HF generation speed: {speed['vllm'] / max(speed['hf'], 1e-9):.1f}x")
EOF

echo "== engines benchmark"
"$PY" benchmarks/engines.py --out "$OUT/engines.json"

echo "== FSDP"
"$PY" -m pytest -q -rs tests/test_sharding.py -p no:cacheprovider | tee "$OUT/sharding.txt"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" -m empo2.cli train --overwrite "${RUN[@]}" \
  policy.lora=false train.learning_rate=1e-6 train.sharding=fsdp train.output_dir="$OUT/run_fsdp" \
  > "$OUT/run_fsdp.log" 2>&1 || { tail -40 "$OUT/run_fsdp.log"; exit 1; }
"$PY" -m empo2.cli export "$OUT/run_fsdp" "$OUT/fsdp_export"
"$PY" -c "import sys, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); \
print('FSDP export loads:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')" "$OUT/fsdp_export"
grep -h "peak" "$OUT/run_fsdp.log" | tail -2 || true
