"""The policy update (the paper's loss; docs/fidelity.md, *The loss*): mini-batches of rollout rows, token-budgeted
micro-batches, the clipped policy-gradient loss, gradient clipping and one optimizer step per mini-batch — data
parallel when ``dist`` spans several ranks."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from contextlib import nullcontext

import torch

from empo2.algo.losses import micro_batch_share
from empo2.algo.modes import behaviour_logp_for_ratio, uses_tip_free_old_logp
from empo2.config import Config
from empo2.parallel import distributed as dp
from empo2.parallel import sharding
from empo2.policy import prefix as px
from empo2.policy.generate import scoring_temperature
from empo2.policy.loader import autocast_context
from empo2.policy.logprobs import micro_batches, packs_chains, response_logprobs, shared_micro_batches
from empo2.policy.packing import Packing, chain_batches, packed_batches, plan_packing
from empo2.train.compute import Compute, compute_dtype, decide, old_logprobs_source  # noqa: F401  (the last two: public here)
from empo2.train.rows import UpdateRow

log = logging.getLogger("empo2.train")


class PolicyUpdate:
    """Owns nothing: the trainer's model, tokenizer, optimizer, loss and ``dist``, applied to a list of rows."""

    def __init__(self, cfg: Config, model, tokenizer, optimizer, loss_fn, dist,
                 options: px.ComputeOptions | None = None, *, compute: Compute | None = None):
        """``compute``: the run's decisions (:func:`empo2.train.compute.decide`); without it they are decided here
        from ``cfg``, with ``options`` as generation's compute options where given."""
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.optimizer, self.loss_fn, self.dist = optimizer, loss_fn, dist
        compute = compute or decide(cfg, options)[1]
        self.options = compute.update_options
        """Compute options of the forwards without grad (reference and tip-free log-probs)."""
        # A checkpointed layer runs without the shared head's KV cache (transformers drops it; replaying would append
        # to it twice), so with gradient checkpointing every training row runs its whole prompt.
        self.shared = self.options.prefix_sharing and not cfg.train.gradient_checkpointing
        """Prefix sharing in the training forwards."""
        self.train_options = dataclasses.replace(self.options, prefix_sharing=self.shared)
        self.old_logprobs = compute.old_logprobs
        """``trainer`` or ``engine``: where the ratio's π_old comes from (``algo.old_logprobs``)."""
        self.loss_algo = dataclasses.replace(cfg.algo, dr_grpo_length=cfg.algo.dr_grpo_length
                                             or cfg.policy.max_completion_length)
        """The ``algo`` section the loss reads, with Dr.GRPO's constant length resolved."""

    def __call__(self, rows: list[UpdateRow], progress=None) -> dict[str, float]:
        """``ppo_epochs`` passes over the rows; each pass is shuffled and cut into mini-batches of
        ``mini_batch_size`` rows (0 = all), one optimizer step per mini-batch, each normalised by all of its response
        tokens (the paper's 1/(N·T)), zero-advantage rows included. A zero-advantage row's loss and gradient are exactly
        0 when β = 0, so its forward and backward are skipped; it still counts in the cut and the denominator, and a
        mini-batch of such rows alone still takes its (zero-gradient) optimizer step, so the step size does not depend
        on how many groups happened to score alike. ``algo.drop_zero_advantage_rows`` drops them before the cut
        instead (DAPO-style filtering). A mini-batch is processed in token-budgeted micro-batches whose gradients add
        up to the mini-batch's.

        Rows whose tokens chain (step t's prompt + response start step t+1's prompt, the ``append`` prompt layout)
        take their log-probs from one forward of the chain's last row (:mod:`empo2.policy.packing`; exact) where they
        share a micro-batch, and the micro-batches keep them together. ``train.pack_episodes`` also keeps them in
        one mini-batch: the rows' chains (an episode's steps) are shuffled whole and a mini-batch holds the chains
        that start among its ``mini_batch_size`` rows. That is the one difference from a shuffle of single rows, and
        only where chains exist and mini-batches cut the rows.

        Returns the loss's metrics (means over micro-batches) and counts: ``rows``, ``computed_rows`` (the rows with
        a gradient, which are forwarded), ``expert_rows``, ``response_tokens``, ``tokens`` (prompt + response of each
        computed row, summed over the PPO epochs), ``tokens_forwarded`` (the tokens the trained forwards took, summed
        likewise: a packed sequence's prompt and continuation once for all its rows, so ``tokens`` −
        ``tokens_forwarded`` is what packing saved), ``optimizer_steps``, ``skipped_steps``."""
        cfg, model = self.cfg, self.model
        if cfg.algo.drop_zero_advantage_rows:
            rows = [r for r in rows if _has_gradient(r, cfg.algo.beta)]
        if not self.dist.all_reduce([len(rows)])[0]:  # data parallel: no rank has rows, so no rank steps
            return {"rows": 0, "computed_rows": 0, "expert_rows": 0, "response_tokens": 0, "tokens": 0,
                    "tokens_forwarded": 0, "optimizer_steps": 0, "skipped_steps": 0}
        gap = {}
        if self.old_logprobs == "trainer":  # an expert's action has no π_old and no engine log-probs to correct
            with sharding.gathered(model):  # each rank's own number of forwards: no collective inside
                rows, gap = self._trainer_old_logp(rows)
        if cfg.algo.off_policy_ratio == "tip_free":
            with sharding.gathered(model):  # one forward per row of this rank's: no collective inside
                rows = self._tip_free_old_logp(rows)
        model.train()
        sums: Counter = Counter()
        n_mb = steps = skipped = forwarded = 0
        size = dp.local_mini_size(self.dist, cfg.train.mini_batch_size, len(rows))
        chains = plan_packing([r.train_prompt for r in rows], [r.response for r in rows]).members \
            if cfg.train.pack_episodes and size < len(rows) else [[i] for i in range(len(rows))]
        for _ in range(cfg.train.ppo_epochs):
            minis = mini_batches(rows, chains, size)
            for m in range(dp.step_count(self.dist, len(minis))):  # every rank takes as many steps
                ok, micro, fwd = self._accumulate(minis[m] if m < len(minis) else [], sums)  # out of rows: zero grad
                n_mb, forwarded = n_mb + micro, forwarded + fwd
                if self._step(inputs_ok=ok):
                    steps += 1
                else:
                    skipped += 1
                if progress:
                    progress("update", m + 1, len(minis))
        model.eval()
        out = {k: v / max(n_mb, 1) for k, v in sums.items()}
        computed = [r for r in rows if _has_gradient(r, cfg.algo.beta)]
        processed = sum(len(r.train_prompt) + len(r.response) for r in computed) * cfg.train.ppo_epochs
        out.update(rows=len(rows), computed_rows=len(computed), expert_rows=sum(r.off_policy for r in rows),
                   response_tokens=sum(len(r.response) for r in rows),
                   tokens=processed, tokens_forwarded=forwarded, optimizer_steps=steps, skipped_steps=skipped, **gap)
        return out

    def _accumulate(self, mini: list[UpdateRow], sums: Counter) -> tuple[bool, int, int]:
        """Backward of one mini-batch in token-budgeted micro-batches, their metrics added to ``sums``. Returns
        whether every micro-batch's inputs were finite, how many micro-batches ran, and the tokens they forwarded
        (packed sequences' prompts and continuations; the rows' own prompts and responses where nothing packs)."""
        # the loss is normalised over the global mini-batch (all ranks' m-th mini-batches)
        tokens, count = self.dist.all_reduce([sum(len(r.response) for r in mini), len(mini)])
        live = [r for r in mini if _has_gradient(r, self.cfg.algo.beta)]
        ok, n_mb = True, 0
        # each shared prompt head runs once per step (forward and backward), not once per micro-batch
        min_shared = self.options.min_shared_tokens
        pack = packs_chains(self.model, self.train_options)
        # planned once per step: the shared heads are the packed prompts, and the micro-batches cut the same sequences
        packing = plan_packing([r.train_prompt for r in live], [r.response for r in live]) if pack else None
        head_prompts = packing.prompts if packing is not None else [r.train_prompt for r in live]
        forwarded = packing.forwarded_tokens if packing is not None \
            else sum(len(r.train_prompt) + len(r.response) for r in live)
        heads = px.heads_once_per_step(head_prompts, min_shared) if self.shared and live else nullcontext()
        with heads as step_heads:
            batches = token_batches(live, self.cfg.train.micro_batch_tokens, self.shared, min_shared, pack, packing)
            idle = sharding.idle_count(self.dist, len(batches))  # FSDP: as many passes as the busiest rank
            for batch in batches:
                metrics, batch_ok = self._backward(batch, tokens, count, step_heads)
                ok &= batch_ok
                sums.update(metrics)
                n_mb += 1
        sharding.idle_passes(self.model, idle, self._reference if self.cfg.algo.beta > 0 else None)
        return ok, n_mb, forwarded

    def _backward(self, batch: list[UpdateRow], mini_tokens: float, mini_rows: float,
                  step_heads: px.StepHeads | None = None) -> tuple[dict[str, float], bool]:
        """Loss and backward of one micro-batch, weighted by its share of the mini-batch (its response tokens and
        rows over all ranks); ``step_heads``: the optimizer step's shared heads."""
        cfg = self.cfg
        prompts = [r.train_prompt for r in batch]
        responses = [r.response for r in batch]
        with autocast_context(self.model, self.cfg.policy.autocast):
            logp_new, mask = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id,
                                               temperature=self.temperature, options=self.train_options,
                                               step_heads=step_heads)
        logp_old = _pad([r.logp_old for r in batch], logp_new.shape[1]).to(logp_new.device)
        adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32, device=logp_new.device)  # [B]
        if any(r.token_weights is not None for r in batch):  # truncated IS: a weight w ≥ 0 scales the clipped term
            weights = [r.token_weights or [1.0] * len(r.response) for r in batch]
            adv = adv[:, None] * _pad(weights, logp_new.shape[1]).to(logp_new.device)  # [B, T]
        logp_ref = None
        if cfg.algo.beta > 0:  # the trained forward's options: a checkpointed layer in train mode drops a shared head
            with torch.no_grad(), self._reference(), autocast_context(self.model, self.cfg.policy.autocast):
                logp_ref, _ = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id,
                                                temperature=self.temperature, options=self.train_options)
        extra = {"off_policy": [r.off_policy for r in batch]} if any(r.off_policy for r in batch) else {}
        for name in sorted({name for r in batch for name in r.extras}):  # the algorithm's own row fields
            if any(r.extras.get(name) for r in batch):
                extra[name] = torch.tensor([r.extras[name] for r in batch])
        loss, metrics = self.loss_fn(logp_new, logp_old, adv, mask, self.loss_algo, logp_ref=logp_ref,
                                     modes=[r.mode for r in batch], **extra)
        share = micro_batch_share(cfg.algo, mask.sum().item(), len(batch), mini_tokens, mini_rows)
        ok = metrics.get("skipped", 0.0) == 0.0
        if ok:
            (loss * share).backward()
        elif self.dist.sharded:  # every FSDP rank joins each backward's reduce-scatter; this one adds zero
            (logp_new.sum() * 0.0).backward()
        return metrics, ok

    def _step(self, inputs_ok: bool) -> bool:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # rows skipped for their exactly-zero gradient: AdamW's moments still take the step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        inputs_ok = self.dist.all_reduce_grads(params, inputs_ok)  # data parallel: sum over ranks; else a no-op
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        if not inputs_ok or not torch.isfinite(norm):
            why = "non-finite loss inputs" if not inputs_ok else f"non-finite gradient norm ({float(norm)})"
            log.warning("%s: optimizer step skipped, weights unchanged", why)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _reference(self):
        """The reference policy is the model with its LoRA adapter disabled (no second copy of the weights)."""
        if self.cfg.policy.lora:
            return self.model.disable_adapter()
        raise RuntimeError("algo.beta > 0 with full fine-tuning needs a reference copy; use policy.lora=true")

    @property
    def temperature(self) -> float:
        """Every log-prob of the update (new, reference, recomputed old) is taken at the rollouts' sampling
        temperature, as the behaviour log-probs are (TRL's convention: log-softmax(logits / T))."""
        return scoring_temperature(self.cfg.policy.temperature)

    @torch.no_grad()
    def _trainer_old_logp(self, rows: list[UpdateRow]) -> tuple[list[UpdateRow], dict[str, float]]:
        """``rows`` with the engine's behaviour log-probs replaced by the trainer's forward on each row's sampling
        prompt and, with ``algo.tis_cap`` > 0, each token's truncated importance weight min(π_trainer/π_engine, cap),
        for every row with a gradient that is not an expert's (new rows; the others as they were). Also the
        engine/trainer gap |log π_trainer − log π_engine| (mean and max over tokens) and the weights' mean."""
        todo = [i for i, r in enumerate(rows) if _has_gradient(r, self.cfg.algo.beta) and not r.off_policy]
        prompts = [rows[i].rollout_prompt or rows[i].train_prompt for i in todo]
        responses = [rows[i].response for i in todo]
        cap, gaps, weights, fresh = self.cfg.algo.tis_cap, [], [], {}
        budget = self.cfg.train.micro_batch_tokens
        plan = lambda p, r: list(micro_batches(p, r, budget, sort=False))  # noqa: E731
        pack = packs_chains(self.model, self.options)
        for batch in packed_batches(plan_packing(prompts, responses), plan) if pack else plan(prompts, responses):
            with autocast_context(self.model, self.cfg.policy.autocast):
                lp, _ = response_logprobs(self.model, [prompts[k] for k in batch], [responses[k] for k in batch],
                                          self.tokenizer.pad_token_id, temperature=self.temperature,
                                          options=self.options)
            for j, k in enumerate(batch):
                row = rows[todo[k]]
                trainer = lp[j, : len(row.response)].double().cpu()
                log_w = trainer - torch.tensor(row.logp_old, dtype=torch.float64)  # [T]
                gaps.append(log_w.abs())
                token_weights = torch.exp(log_w).clamp(max=cap).tolist() if cap > 0 else row.token_weights
                if cap > 0:
                    weights.append(torch.tensor(token_weights))
                fresh[todo[k]] = dataclasses.replace(row, logp_old=trainer.tolist(), token_weights=token_weights)
        rows = [fresh.get(i, r) for i, r in enumerate(rows)]
        if not gaps:
            return rows, {}
        gap = torch.cat(gaps)
        out = {"old_logp_gap_mean": float(gap.mean()), "old_logp_gap_max": float(gap.max())}
        if weights:
            out["tis_weight_mean"] = float(torch.cat(weights).mean())
        return rows, out

    @torch.no_grad()
    def _tip_free_old_logp(self, rows: list[UpdateRow]) -> list[UpdateRow]:
        """Pre-release variant: ``rows`` with the old log-probs of off_tips rows with a gradient recomputed on the
        tip-free prompt (new rows; the others as they were)."""
        out, variant = [], self.cfg.algo.off_policy_ratio
        for r in rows:
            if uses_tip_free_old_logp(r.mode, variant) and _has_gradient(r, self.cfg.algo.beta):
                with autocast_context(self.model, self.cfg.policy.autocast):
                    lp, _ = response_logprobs(self.model, [r.train_prompt], [r.response], self.tokenizer.pad_token_id,
                                              temperature=self.temperature, options=self.options)
                r = dataclasses.replace(r, logp_old=behaviour_logp_for_ratio(
                    r.mode, torch.tensor(r.logp_old), lp[0], variant=variant).tolist())
            out.append(r)
        return out


def _has_gradient(row: UpdateRow, beta: float) -> bool:
    """Whether the row's loss can have a non-zero gradient: a non-zero advantage, or a KL term (β > 0)."""
    return row.advantage != 0.0 or beta > 0


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def mini_batches(rows: list[UpdateRow], chains: list[list[int]], size: int) -> list[list[UpdateRow]]:
    """One epoch's mini-batches: ``chains`` (lists of row indices, each row in one) shuffled whole, then cut every
    ``size`` rows of that order, each chain going whole to the mini-batch its first row falls in (a cut inside a
    chain moves to the chain's end; :func:`~empo2.policy.packing.chain_batches`). Chains of one row each give the
    shuffle of single rows cut every ``size``."""
    order = list(chains)
    random.shuffle(order)
    return [[rows[i] for i in batch] for batch in chain_batches(order, size)]


def token_batches(rows: list[UpdateRow], budget: int, shared: bool = False,
                  min_shared: int = 16, pack: bool = False, packing: Packing | None = None) -> list[list[UpdateRow]]:
    """Split one optimizer step's rows into micro-batches that each compute at most ``budget`` tokens (a row over it
    gets one of its own): in order, costed as the padded layout (rows × (longest prompt + longest response),
    :func:`~empo2.policy.logprobs.micro_batches`), or with ``shared`` grouped by prompt head and costed as computed
    with the step's heads held (:func:`~empo2.policy.logprobs.shared_micro_batches`; order in a mini-batch is free).
    ``pack``: rows are packed (:func:`~empo2.policy.logprobs.packs_chains`), so the packed sequences are cut and
    costed, each micro-batch holding all of a sequence's rows; ``packing``: the rows' :func:`plan_packing` where the
    caller has planned it (else planned here)."""
    prompts, responses = [r.train_prompt for r in rows], [r.response for r in rows]
    if shared:
        plan = lambda p, r: shared_micro_batches(p, r, budget, min_shared, step_heads=True)  # noqa: E731
    else:
        plan = lambda p, r: list(micro_batches(p, r, budget, sort=False))  # noqa: E731
    if pack:
        idx = packed_batches(packing if packing is not None else plan_packing(prompts, responses), plan)
    else:
        idx = plan(prompts, responses)
    return [[rows[i] for i in b] for b in idx]
