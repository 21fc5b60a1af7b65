"""``policy.autocast: auto``: bfloat16 compute where the hardware runs it natively, the weights' float32 elsewhere.

A CPU without AVX512-BF16 or AMX has no bfloat16 matmul instructions, so bfloat16 autocast there converts every
operand and runs slower than float32 (records/benchmarks.md); with either of them, or on a GPU that supports bfloat16,
bfloat16 is the fast path. ``auto`` is decided once per process from the CPU's flags (Linux ``/proc/cpuinfo``) or the
GPU's capability, and a run records the decision in its ``config.yaml``.

``EMPO2_NATIVE_BF16=0`` (or ``1``) fixes the answer whatever the hardware: the test suite sets 0, so that it computes
the same float32 numbers on every CPU of a machine kind whose CPUs differ.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""``/proc/cpuinfo`` flags of CPUs with bfloat16 matmul instructions."""
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The ``/proc/cpuinfo`` flags that choose the matmul kernels (and ``policy.autocast: auto``) on an x86-64 CPU,
narrowest first."""
OVERRIDE_ENV = "EMPO2_NATIVE_BF16"


@dataclass(frozen=True)
class AutoPrecision:
    autocast: str
    """``bfloat16`` or ``none``: what ``policy.autocast: auto`` becomes."""
    reason: str
    """Why, in a few words, for the run's banner."""


def isa_flags(flags: set[str] | None) -> list[str]:
    """The :data:`ISA_FLAGS` among ``flags`` (a CPU's), narrowest first: the last is the widest the CPU has."""
    return [f for f in ISA_FLAGS if flags and f in flags]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags, or ``None`` where ``/proc/cpuinfo`` cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def decide(device_type: str, flags: set[str] | None, gpu_bf16: bool = False) -> AutoPrecision:
    """The decision for a device type (``cpu``, ``cuda`` …), the CPU's flags and whether the GPU supports bfloat16."""
    if device_type != "cpu":
        if gpu_bf16:
            return AutoPrecision("bfloat16", f"{device_type} supports bfloat16")
        return AutoPrecision("none", f"{device_type} without bfloat16")
    if flags is None:
        return AutoPrecision("none", "CPU flags unreadable")
    native = [f for f in NATIVE_BF16_CPU_FLAGS if f in flags]
    if native:
        return AutoPrecision("bfloat16", f"CPU has {', '.join(native)}")
    return AutoPrecision("none", "CPU has no avx512_bf16/amx_bf16")


@functools.cache
def auto_precision(device: str = "auto") -> AutoPrecision:
    """What ``auto`` means on ``device`` (``policy.device``) on this machine; decided once per process."""
    forced = os.environ.get(OVERRIDE_ENV)
    if forced in ("0", "1"):
        return AutoPrecision("bfloat16" if forced == "1" else "none", f"{OVERRIDE_ENV}={forced}")
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    gpu_bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported()
    return decide(dev.type, cpu_flags() if dev.type == "cpu" else None, gpu_bf16)


def resolve_autocast(autocast: str, device: str = "auto") -> str:
    """``policy.autocast`` with ``auto`` replaced by this machine's decision."""
    return auto_precision(device).autocast if autocast == "auto" else autocast


def settle_autocast(policy_cfg) -> str | None:
    """Replace ``policy.autocast: auto`` in the config section by its decision, so the run's saved config records
    it; returns the reason for the banner (``None`` when the config named a precision itself)."""
    if policy_cfg.autocast != "auto":
        return None
    decision = auto_precision(policy_cfg.device)
    policy_cfg.autocast = decision.autocast
    return decision.reason


def engine_dtype(autocast: str, weights_dtype: str, device: str = "auto") -> str:
    """The dtype of a separate generation engine (``policy.backend: vllm``): the trainer's compute dtype, or the
    weights' own where it has no autocast, so both sample and score from numbers of the same precision."""
    compute = resolve_autocast(autocast, device)
    return weights_dtype if compute == "none" else compute
