"""The run's compute decisions, made once from its config by :func:`decide` and read everywhere else:

- ``policy.autocast: auto`` becomes this machine's precision (:mod:`empo2.policy.precision`);
- ``policy.backend: auto`` becomes the engine measured faster here (:mod:`empo2.policy.engine_choice`);
- the dtype the policy's forwards compute in, and where the ratio's π_old comes from (``algo.old_logprobs``);
- the compute options of generation, and of the update's forwards (without prefix sharing under FSDP).

``empo2 train`` prints them in its banner, with why ``auto`` chose what it chose; the trainer hands them to the
rollout context and the update.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from empo2.config import Config
from empo2.parallel import sharding
from empo2.policy.engine_choice import resolve_backend
from empo2.policy.loader import resolve_device, resolve_dtype
from empo2.policy.precision import auto_precision, resolve_autocast
from empo2.policy.prefix import ComputeOptions, compute_options


@dataclass(frozen=True)
class Compute:
    autocast: str
    """``policy.autocast`` settled: ``none``, ``bfloat16`` or ``float16``."""
    backend: str
    """``policy.backend`` settled: the rollout engine."""
    dtype: str
    """The dtype the policy's forwards compute in (:func:`compute_dtype`)."""
    old_logprobs: str
    """``trainer`` or ``engine``: where the ratio's π_old comes from (:func:`old_logprobs_source`)."""
    options: ComputeOptions
    """Generation's compute options (prefix sharing, head reuse, autocast dtype, log-prob chunks)."""
    update_options: ComputeOptions
    """The update's: the same, without prefix sharing under FSDP."""
    why: dict[str, str] = field(default_factory=dict)
    """For each setting ``auto`` decided (``autocast``, ``backend``), why, in a few words."""

    def engine_dtype(self, weights_dtype: str) -> str:
        """The dtype of a separate generation engine (``policy.backend: vllm``): the trainer's autocast dtype, or
        the weights' own where it has none, so both sample and score from numbers of the same precision."""
        return weights_dtype if self.autocast == "none" else self.autocast


def decide(config: Config, options: ComputeOptions | None = None) -> tuple[Config, Compute]:
    """The config with ``policy.autocast`` and ``policy.backend`` settled (a new config and policy section: ``config``
    is left as it was; its other sections are shared), and the decisions. ``options``: generation's compute options
    where the caller fixes them (default: from the config)."""
    policy, why = config.policy, {}
    autocast = policy.autocast
    if autocast == "auto":
        decision = auto_precision(policy.device)
        autocast, why["autocast"] = decision.autocast, decision.reason
    backend, backend_why = resolve_backend(policy)
    if backend_why:
        why["backend"] = backend_why
    policy = dataclasses.replace(policy, autocast=autocast, backend=backend)
    settled = dataclasses.replace(config, policy=policy)
    options = options or compute_options(policy, config.train)
    dtype = compute_dtype(policy)
    return settled, Compute(autocast, backend, dtype, old_logprobs_source(config.algo.old_logprobs, backend, dtype),
                            options, sharding.update_options(options, settled), why)


def old_logprobs_source(setting: str, backend: str, compute: str) -> str:
    """``algo.old_logprobs`` resolved: ``auto`` is ``trainer`` when a separate engine samples or when the forwards
    run in a 16-bit ``compute`` dtype, ``engine`` only for the HF engine in float32.

    In 16 bits, sampling (one token at a time against a KV cache) and the training forward (the whole response at
    once, in another batch layout) round differently, so an engine π_old would start the ratio at e^{rounding} ≠ 1
    and the clip would act on rounding noise; in float32 the two agree to about 1e-6 and the recompute is saved."""
    if setting != "auto":
        return setting
    return "engine" if backend == "hf" and compute == "float32" else "trainer"


def compute_dtype(policy_cfg) -> str:
    """The dtype the policy's forwards compute in: the autocast dtype, else the weights' (``auto``: float32 on a
    CPU, bfloat16 on a GPU)."""
    autocast = resolve_autocast(policy_cfg.autocast, policy_cfg.device)
    if autocast != "none":
        return autocast
    return str(resolve_dtype(policy_cfg.dtype, resolve_device(policy_cfg.device))).removeprefix("torch.")
