"""``policy.backend: auto``: the rollout engine that was measured faster on this kind of machine.

The table holds what ``benchmarks/engines.py`` measured (records/benchmarks.md), keyed by the CPU's widest vector
feature (:data:`empo2.policy.precision.ISA_FLAGS`). A feature set with no measurement of its own takes the nearest
narrower one that has, and says so; a GPU has no measurement yet and takes the reference engine. The decision and its reason
go into the run's banner, and the saved config records the engine chosen.
"""

from __future__ import annotations

from empo2.policy.precision import isa_flags

MEASURED: dict[str, tuple[str, str]] = {
    "avx2": ("hf", "vLLM 0.56× HF env-steps/s, 0.38× iteration speed (engines.py, AMD EPYC AVX2, 2026-12-01)"),
    "avx512_bf16": ("hf", "vLLM bf16 2.24× HF bf16 env-steps/s, 0.86× iteration speed "
                          "(engines.py, AMD EPYC AVX512-BF16, 2026-12-05)"),
    "amx_bf16": ("hf", "merged bf16 copy 1.63× HF fp32 env-steps/s, 0.82× iteration speed; HF bf16 autocast 0.63× "
                       "(engines.py --preset reach, Intel Xeon AMX, 2026-12-06)"),
}
"""Widest CPU feature → (the engine with the shorter training iteration, the measurement). A training run pays for
whole iterations, so the iteration decides where one engine rolls out faster and the other updates faster."""


def choose(device_type: str, flags: set[str] | None) -> tuple[str, str]:
    """The engine for a device type (``cpu``, ``cuda``) and CPU flags, and why, in a few words."""
    if device_type != "cpu":
        return "hf", f"{device_type}: no engines.py measurement yet, the reference engine"
    have = isa_flags(flags)
    widest = have[-1] if have else None
    if widest in MEASURED:
        engine, why = MEASURED[widest]
        return engine, f"{widest}: {why}"
    for narrower in reversed(have[:-1]):
        if narrower in MEASURED:
            engine, why = MEASURED[narrower]
            return engine, f"{widest} not measured; nearest measured, {narrower}: {why}"
    return "hf", f"{widest or 'this CPU'}: not measured, the reference engine"


def resolve_backend(policy_cfg) -> tuple[str, str | None]:
    """``policy.backend``, with ``auto`` replaced by the engine :func:`choose` picks here, and the reason for the
    banner (``None`` when the config named an engine itself)."""
    if policy_cfg.backend != "auto":
        return policy_cfg.backend, None
    import torch

    from empo2.policy.precision import cpu_flags

    device = policy_cfg.device
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device).type
    return choose(kind, cpu_flags() if kind == "cpu" else None)


def settle_backend(policy_cfg) -> str | None:
    """Replace ``policy.backend: auto`` in the config section by :func:`resolve_backend`'s engine; returns the
    reason (``None`` when the config named an engine itself)."""
    policy_cfg.backend, why = resolve_backend(policy_cfg)
    return why
