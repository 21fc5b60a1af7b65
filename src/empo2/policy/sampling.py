"""What one generation call samples, as one frozen value: built from the config where the run starts, handed
unchanged through the rollout to the engine (:func:`empo2.policy.generate.generate_batch`, the backends of
:mod:`empo2.policy.backend`), in the spirit of vLLM's ``SamplingParams``.

A run samples three ways, each from its own ``policy`` fields: the training rollouts (:meth:`Sampling.rollout`),
the end-of-episode reflections (:meth:`Sampling.reflection`) and the evaluations (:meth:`Sampling.rollout` at the
evaluation's temperature). The per-row seeds are not part of it: they change with every row and turn.
"""

from __future__ import annotations

from dataclasses import dataclass


def scoring_temperature(temperature: float, greedy: bool = False) -> float:
    """The temperature behaviour log-probs are taken at: the sampling temperature, or 1 for greedy decoding
    (``greedy`` or temperature 0). The update scores ``logp_new`` at the same value, so its ratio compares like with
    like."""
    return 1.0 if greedy or temperature <= 0 else float(temperature)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    """Tokens generated at most per row (up to and including the end-of-sequence token)."""
    temperature: float = 1.0
    """Divides the logits before sampling; 0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling's mass (1: off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    greedy: bool = False
    """Decode greedily whatever the temperature."""

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn (not greedy decoding)."""
        return not self.greedy and self.temperature > 0

    @property
    def scoring_temperature(self) -> float:
        """The temperature the behaviour log-probs are taken at (:func:`scoring_temperature`)."""
        return scoring_temperature(self.temperature, self.greedy)

    @classmethod
    def rollout(cls, policy_cfg, temperature: float | None = None, greedy: bool = False) -> Sampling:
        """An action's sampling: ``policy.max_completion_length``, ``policy.top_p`` / ``top_k``, at
        ``policy.temperature`` or at ``temperature`` where given (an evaluation's)."""
        return cls(policy_cfg.max_completion_length,
                   policy_cfg.temperature if temperature is None else temperature,
                   policy_cfg.top_p, policy_cfg.top_k, greedy)

    @classmethod
    def reflection(cls, policy_cfg) -> Sampling:
        """A tip's sampling: ``policy.reflection_max_tokens`` at ``policy.reflection_temperature``."""
        return cls(policy_cfg.reflection_max_tokens, policy_cfg.reflection_temperature, policy_cfg.top_p,
                   policy_cfg.top_k)
