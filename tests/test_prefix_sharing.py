"""Shared-prefix generation and log-probs equal the plain (unshared, padded) paths; bfloat16 autocast stays close.

Tiny randomly initialised Llama / GPT-2 models (built from configs, no download) for the numerics, plus the real
SmolLM2 for greedy generation on ScienceWorld-like prompts.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from empo2.policy import kv_cache
from empo2.policy import prefix as px
from empo2.policy.generate import generate_batch
from empo2.policy.logprobs import response_logprobs
from empo2.policy.sampling import Sampling

PAD = 0
SHARED = px.ComputeOptions(min_shared_tokens=8)
"""Prefix sharing with heads of 8 tokens or more (the tiny models' prompts are short)."""
PLAIN = px.ComputeOptions(prefix_sharing=False)


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def shared_rows(seed, heads=(30, 22), per_head=3, tail=(1, 12), resp=(0, 9)):
    """Rows in groups sharing a random head (one group's tails include a 1-token tail), random responses."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    prompts, responses = [], []
    for h in heads:
        head = rand(h)
        for k in range(per_head):
            n = 1 if k == 0 else int(torch.randint(tail[0], tail[1] + 1, (1,), generator=g))
            prompts.append(head + rand(n))
            responses.append(rand(int(torch.randint(resp[0], resp[1] + 1, (1,), generator=g))))
    prompts.append(rand(17))  # a row that shares nothing
    responses.append(rand(5))
    return prompts, responses


class Tok:
    """The two tokenizer attributes and the decode that generation uses (a tiny model has no real tokenizer)."""

    pad_token_id, eos_token_id = PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_plan_groups_covers_rows_and_heads_are_common():
    prompts, _ = shared_rows(0)
    groups = px.plan_groups(prompts, min_shared=8)
    assert sorted(r for rows, _ in groups for r in rows) == list(range(len(prompts)))
    assert sorted(head for _, head in groups if head) == [22, 30]
    for rows, head in groups:
        assert all(prompts[r][:head] == prompts[rows[0]][:head] and len(prompts[r]) > head for r in rows)
    assert px.plan_groups([[1, 2, 3], [4, 5]], min_shared=1) == [([0], 0), ([1], 0)]
    assert px.plan_layout([[1, 2, 3], [4, 5]], min_shared=1) is None
    # with sharing, a lone row gets its own head (all but its last token), so its tail does not pad the others
    layout = px.plan_layout(prompts, min_shared=8)
    assert ([len(prompts) - 1], 16) in layout and all(len(prompts[r]) - h <= 12 for rows, h in layout for r in rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_logprobs_equal_plain_values_and_grads(seed):
    model = tiny_lm(seed)
    prompts, responses = shared_rows(seed)
    model.zero_grad()
    plain, mask = response_logprobs(model, prompts, responses, PAD, options=PLAIN)
    (plain * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    options = px.ComputeOptions(prefix_sharing=True, min_shared_tokens=8, logprob_chunk_tokens=7)
    shared, mask2 = response_logprobs(model, prompts, responses, PAD, options=options)
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    (shared * mask).sum().backward()
    for n, p in model.named_parameters():  # float32 summation order differs: within 1e-5 of the gradient's scale
        torch.testing.assert_close(p.grad, want[n], atol=1e-5 * float(want[n].abs().max()), rtol=0, msg=n)
    # And both against an independent float64 reference (unpadded single-row forward)
    ref = model.double()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if r:
            with torch.no_grad():
                lp = torch.log_softmax(ref(torch.tensor([p + r])).logits[0], -1)[len(p) - 1: -1]
            np.testing.assert_allclose(shared[i, : len(r)].detach().numpy(),
                                       lp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1).numpy(), atol=1e-5)


def test_shared_logprobs_gpt2_absolute_positions():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=1)).eval()
    prompts, responses = shared_rows(3)
    with torch.no_grad():
        plain, _ = response_logprobs(gpt2, prompts, responses, PAD, options=PLAIN)
        shared, _ = response_logprobs(gpt2, prompts, responses, PAD, options=SHARED)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_shared_greedy_generation_equals_plain_tiny():
    model = tiny_lm(2)
    prompts, _ = shared_rows(4)
    shared = generate_batch(model, Tok(), prompts, Sampling(12, greedy=True), options=SHARED)
    plain = generate_batch(model, Tok(), prompts, Sampling(12, greedy=True), options=PLAIN)
    assert [s.ids for s in shared] == [p.ids for p in plain]
    for s, p in zip(shared, plain):
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-5)
    # behaviour log-probs of a sampled run equal a plain forward's at the sampling temperature (log-softmax(logits
    # / T); top-p filtering is not in them, which is why training refuses top-p)
    sampled = generate_batch(model, Tok(), prompts, Sampling(6, temperature=0.7, top_p=0.9), generator_seed=5, options=SHARED)
    lp, _ = response_logprobs(model, prompts, [s.ids for s in sampled], PAD, temperature=0.7, options=PLAIN)
    for i, s in enumerate(sampled):
        np.testing.assert_allclose(s.logprobs, lp[i, : len(s.ids)].detach().numpy(), atol=1e-5)


def test_cache_with_room_appends_in_place_and_holds_the_same_keys():
    """``make_cache(room=n)`` (decoding) writes n appended tokens into spare capacity instead of re-copying the cache;
    past its room it grows; at every step its keys and values equal a plain DynamicCache's, and a model forward over
    it gives the same logits."""
    model = tiny_lm(7)
    g = torch.Generator().manual_seed(7)
    layers = [(torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)) for _ in range(2)]
    roomy, plain = kv_cache.make_cache(model, layers, room=3), kv_cache.make_cache(model, layers)
    buffers = [layer.keys.data_ptr() for layer in roomy.layers]  # a layer's keys are a view from its buffer's start
    for step in range(5):  # appends 1..3 fit, 4 and 5 grow the buffers
        new = [(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)) for _ in range(2)]
        for i, (k, v) in enumerate(new):
            for cache in (roomy, plain):
                cache.update(k, v, i)
        same_buffers = [layer.keys.data_ptr() for layer in roomy.layers] == buffers
        assert same_buffers == (step < 3), step
        for a, b in zip(roomy.layers, plain.layers):
            assert a.keys.shape[2] == b.keys.shape[2] == 6 + step
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    ids = torch.randint(3, 256, (2, 4), generator=g)
    pos = torch.arange(10, 14).repeat(2, 1)
    logits = [model(input_ids=ids, position_ids=pos, use_cache=True, **kv_cache.cache_kwargs(model, c)).logits
              for c in (roomy, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora", [False, True])
def test_a_forward_on_a_made_cache_continues_the_cached_tokens(lora):
    """``cache_kwargs`` hands ``make_cache``'s cache (plain and with room) to the model under the keyword its
    transformers version reads (``cache``, ``past_key_values`` before the rename): a misnamed cache would vanish into
    the forward's ``**kwargs`` and the tail would run as if nothing came before it. Reference: one float64 forward
    over the whole sequence; with LoRA as the trainer wraps the model."""
    model = tiny_lm(8).double()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, 8:]  # [2, 4, V]
        head = kv_cache.output_cache(model(input_ids=ids[:, :8], use_cache=True))
        layers = [(layer.keys, layer.values) for layer in head.layers]
        for room in (0, 4):
            cache = kv_cache.make_cache(model, layers, room=room)
            got = model(input_ids=ids[:, 8:], position_ids=torch.arange(8, 12).repeat(2, 1),
                        attention_mask=torch.ones((2, 12), dtype=torch.long), use_cache=True,
                        **kv_cache.cache_kwargs(model, cache)).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_reused_heads_generate_the_same_and_skip_known_tokens():
    """Inside ``reuse_heads`` a generation call runs only what follows the previous call's heads (the next steps of
    the same episodes), and greedy tokens and behaviour log-probs equal a fresh computation."""
    model = tiny_lm(5)
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    head, other = rand(40), rand(30)
    step0 = [head + rand(5) for _ in range(3)] + [other + rand(4), other + rand(6)]
    step1 = [p + rand(7) for p in step0[:3]] + [step0[3] + rand(3)]  # episodes go on; the last one has ended
    step2 = [step1[0] + rand(2)]  # a lone row: its own head, mostly known from the last call
    fed = []
    model.model.embed_tokens.register_forward_hook(lambda _m, inputs, _o: fed.append(int(inputs[0].numel())))

    memo = px.HeadMemo()

    def play(reuse: bool):
        fed.clear()
        with memo.reuse(SHARED) if reuse else contextlib.nullcontext():
            calls = [generate_batch(model, Tok(), prompts, Sampling(6, greedy=True), options=SHARED, heads=memo)
                     for prompts in (step0, step1, step2)]
            assert memo.active == reuse
        return calls, sum(fed)

    fresh, fresh_tokens = play(False)
    reused, reused_tokens = play(True)
    for a, b in zip(fresh, reused):
        assert [x.ids for x in a] == [y.ids for y in b]
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    # Step 1: fresh, the 40-token group head, row 3's own 36-token head and 4 tails 12 wide = 124 tokens; reused,
    # every row leaves its group for its own head, of which the memo holds its step-0 prompt: 3 × 6 + 2 new tokens
    # and 4 one-token tails = 24. Step 2 (a lone row): fresh, its 53-token own head and its tail; reused, the memo
    # holds 52 of the 53 (its step-1 prompt). 100 + 52 tokens fewer.
    assert fresh_tokens - reused_tokens == 100 + 52, (fresh_tokens, reused_tokens)
    assert not memo.active  # the memo ends with the block
    with memo.reuse(SHARED):
        assert memo.active
        with memo.reuse(SHARED):  # a nested block keeps the outer one's memo
            assert memo.active
        assert memo.active
        with torch.enable_grad():  # training forwards never read the memo
            out, _ = response_logprobs(model, step1, [[5, 6]] * len(step1), PAD, options=SHARED)
        assert out.requires_grad
    for off in (PLAIN, px.ComputeOptions(reuse_heads=False)):  # options that turn reuse off leave the memo off
        with memo.reuse(off):
            assert not memo.active


def test_compute_options_travel_as_arguments_and_nothing_is_set_on_the_model():
    """A rollout's head memo and an optimizer step's shared heads live in objects the calls are given: the model's
    attributes are the same objects after generating, scoring and a backward as before. The options come from the
    config once (``compute_options``), and an update built from a config keeps its choice."""
    from empo2.algo.losses import get_policy_loss
    from empo2.config import Config
    from empo2.parallel.distributed import Dist
    from empo2.train.update import PolicyUpdate

    model = tiny_lm(1)
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    prompts, responses = shared_rows(1)
    memo = px.HeadMemo()
    with memo.reuse(SHARED):
        gens = generate_batch(model, Tok(), prompts, Sampling(4, greedy=True), options=SHARED, heads=memo)
        fed = max(len(g.ids) for g in gens) - 1  # the last sampled token is never fed
        # the call's rows: each prompt and the response tokens whose KV was computed
        assert [ids for ids, _ in memo.heads] == [p + g.ids[:fed] for p, g in zip(prompts, gens)]
        assert all(k.shape[2] == len(ids) for ids, kv in memo.heads for k, _ in kv)
    with px.heads_once_per_step(prompts, 8) as heads:
        lp, mask = response_logprobs(model, prompts, responses, PAD, options=SHARED, step_heads=heads)
        (lp * mask).sum().backward()
    for name, module in model.named_modules():
        assert vars(module).keys() == before[name].keys(), name
        assert all(vars(module)[k] is v for k, v in before[name].items() if k != "training"), name

    cfg = Config.load(None, ["policy.prefix_sharing=false", "policy.autocast=bfloat16", "policy.reuse_heads=false",
                             "train.logprob_chunk_tokens=64"])
    assert px.compute_options(cfg.policy, cfg.train) == px.ComputeOptions(
        prefix_sharing=False, compute_dtype="bfloat16", logprob_chunk_tokens=64, reuse_heads=False)
    update = PolicyUpdate(cfg, model, Tok(), None, get_policy_loss("grpo"), Dist())
    cfg.policy.prefix_sharing = True  # a config changed after the update was built does not switch it
    assert update.shared is False and update.options.prefix_sharing is False


def test_shared_micro_batches_cover_rows_within_budget():
    from empo2.policy.logprobs import shared_micro_batches

    prompts, responses = shared_rows(5, heads=(40, 25, 33), per_head=4)
    for budget in (1, 60, 120, 400, 10_000):
        batches = shared_micro_batches(prompts, responses, budget, min_shared=8)
        assert sorted(i for b in batches for i in b) == list(range(len(prompts)))
        for b in batches:  # what response_logprobs computes for this micro-batch
            groups = px.plan_layout([prompts[i] for i in b], 8)
            if groups is None:
                cost = len(b) * max(len(prompts[i]) + len(responses[i]) for i in b)
            else:
                tails = {i: len(prompts[b[i]]) - h for rows, h in groups for i in rows}
                cost = sum(h for _, h in groups) + len(b) * max(tails[k] + len(responses[b[k]]) for k in range(len(b)))
            assert cost <= budget or len(b) == 1
    assert len(shared_micro_batches(prompts, responses, 10_000, min_shared=8)) == 1
    # a step's heads are held for all its micro-batches: they count against every micro-batch's budget, once
    held = sum(h for _, h in px.plan_groups(prompts, 8))
    for budget in (1, held + 60, held + 400):
        batches = shared_micro_batches(prompts, responses, budget, min_shared=8, step_heads=True)
        assert sorted(i for b in batches for i in b) == list(range(len(prompts)))
        heads = px.StepHeads([list(prompts[rows[0]][:h]) for rows, h in px.plan_groups(prompts, 8) if h])
        for b in batches:
            layout = heads.layout([prompts[i] for i in b], 8) or [([k], 0) for k in range(len(b))]  # None: padded
            own = sum(h for rows, h in layout if heads.head_of(prompts[b[rows[0]]]) is None)
            width = max(len(prompts[b[i]]) - h + len(responses[b[i]]) for rows, h in layout for i in rows)
            assert held + own + len(b) * width <= budget or len(b) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_heads_once_per_step_give_each_micro_batch_the_same_log_probs_and_the_step_the_same_gradient(seed, monkeypatch):
    """An optimizer step's micro-batches inside ``heads_once_per_step``: each shared head runs forward once, and
    backward once with the gradient all micro-batches left on it; values and the summed gradient are the plain
    (unshared, padded, one batch) ones."""
    from empo2.policy.logprobs import shared_micro_batches

    model = tiny_lm(seed)
    prompts, responses = shared_rows(seed, heads=(40, 25), per_head=5, tail=(1, 20))
    plain, mask = response_logprobs(model, prompts, responses, PAD, options=PLAIN)
    (plain * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    runs = []
    original = px.head_kv
    monkeypatch.setattr(px, "head_kv", lambda *a: runs.append(len(a[1])) or original(*a))
    batches = shared_micro_batches(prompts, responses, 80, min_shared=8, step_heads=True)
    assert len(batches) >= 4  # the heads are shared across micro-batches, not only within one
    with px.heads_once_per_step(prompts, min_shared=8) as heads:
        assert sorted(len(h) for h in heads.heads) == [25, 40]
        for batch in batches:
            lp, m = response_logprobs(model, [prompts[i] for i in batch], [responses[i] for i in batch], PAD,
                                      options=SHARED, step_heads=heads)
            torch.testing.assert_close(lp, plain[batch][:, : lp.shape[1]].detach(), atol=1e-5, rtol=0)
            if m.any():  # a micro-batch of empty responses has no graph
                (lp * m).sum().backward()
    assert sorted(r for r in runs if r in (25, 40)) == [25, 40]  # each shared head ran once for the whole step
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5 * float(want[n].abs().max()), rtol=0, msg=n)


def test_bfloat16_autocast_ratio_stays_near_one():
    """Behaviour log-probs (generation) and training log-probs under the same bfloat16 autocast: ratio ≈ 1.

    Bound: median |ratio − 1| < 1e-2 and max < 0.1 (bfloat16 has 8 mantissa bits; both sides use the same numerics,
    the differences come only from cached vs uncached summation order). float32 stays within 1e-4.
    """
    model = tiny_lm(3)
    prompts, _ = shared_rows(6)
    for dtype, median_bound, max_bound in (("bfloat16", 1e-2, 0.1), ("float32", 1e-5, 1e-4)):
        options = px.ComputeOptions(compute_dtype=dtype, min_shared_tokens=8)
        gens = generate_batch(model, Tok(), prompts, Sampling(8, temperature=1.0), generator_seed=1, options=options)
        model.train()
        new, mask = response_logprobs(model, prompts, [g.ids for g in gens], PAD, options=options)
        model.eval()
        assert new.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
        old = torch.zeros_like(new)
        for r, g in enumerate(gens):
            old[r, : len(g.ids)] = torch.tensor(g.logprobs)
        dev = (new.detach() - old)[mask].exp().sub(1).abs()
        assert float(dev.median()) < median_bound and float(dev.max()) < max_bound, (dtype, dev.median(), dev.max())
        new.sum().backward()  # gradients reach the float32 weights through autocast
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        model.zero_grad(set_to_none=True)


def test_peak_rss_resets_per_iteration():
    """In a fresh interpreter (a long test session's own peak would hide the 200 MB block)."""
    code = textwrap.dedent("""
        import numpy as np
        from empo2.rundir.metrics import peak_rss_gb, reset_peak_rss
        def rss_gb():
            line = next(x for x in open("/proc/self/status").read().splitlines() if x.startswith("VmRSS:"))
            return int(line.split()[1]) * 1024 / 1e9
        reset_peak_rss()
        base = peak_rss_gb()
        block = np.ones(200_000_000 // 8)  # 200 MB touched
        assert peak_rss_gb() > base + 0.15, (peak_rss_gb(), base)
        del block
        reset_peak_rss()
        assert peak_rss_gb() < rss_gb() + 0.1, (peak_rss_gb(), rss_gb())  # the peak restarted from the current size
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_shared_greedy_generation_equals_plain_smollm(smollm):
    """The real SmolLM2 on G=3 ScienceWorld-like prompts: identical at step 0 for two rows, a longer history for one."""
    from empo2.agent.prompts import PromptParts, render_prompt_ids

    model, tok = smollm
    base = PromptParts(env="scienceworld", task="Your task is to find a(n) animal. First, focus on the thing. Then, "
                       "move it to the red box in the kitchen.", observation="This room is called the hallway. In it, "
                       "you see: a picture. You also see: a door to the kitchen.", demonstration="> go to outside\n"
                       "You move to the outside.\n> focus on dove egg\nYou focus on the dove egg.")
    rollout = PromptParts(**{**base.__dict__, "history": [("go to kitchen", "This room is called the kitchen.")],
                             "observation": "This room is called the kitchen."})
    prompts = [render_prompt_ids(tok, p, 2, 1024) for p in (base, base, rollout)]
    assert px.worth_sharing(px.plan_groups(prompts))
    shared = generate_batch(model, tok, prompts, Sampling(8, greedy=True), options=px.DEFAULT_OPTIONS)
    plain = generate_batch(model, tok, prompts, Sampling(8, greedy=True), options=PLAIN)
    assert [s.ids for s in shared] == [p.ids for p in plain]
    for s, p in zip(shared, plain):
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_update_equals_stored_activations(lora):
    """``train.gradient_checkpointing``: the update takes the same step as with stored activations (and its layers
    really run again in backward), although it gives up prefix sharing; with LoRA as the trainer wraps it."""
    from empo2.algo.losses import get_policy_loss
    from empo2.config import Config
    from empo2.parallel.distributed import Dist
    from empo2.policy.loader import enable_gradient_checkpointing
    from empo2.train.rows import UpdateRow
    from empo2.train.update import PolicyUpdate

    prompts, responses = shared_rows(3)
    rows = [UpdateRow(p, r, [-5.5] * len(r), (-1.0) ** i, "on") for i, (p, r) in enumerate(zip(prompts, responses))]
    before, after, layer_calls = None, {}, {}
    for checkpointing in (False, True):
        model = tiny_lm(3)
        if checkpointing:
            enable_gradient_checkpointing(model, "tiny")
        if lora:  # after checkpointing, as loader.make_trainable does; B starts at 0, so the step moves it
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = Config.load("configs/scienceworld_cpu.yaml", ["algo.name=grpo", "train.micro_batch_tokens=120",
                                                             f"train.gradient_checkpointing={checkpointing}"])
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        calls = []
        # the attention inside a layer also runs when backward replays the layer
        attention = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn"))
        attention.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        update = PolicyUpdate(cfg, model, Tok(), optimizer, get_policy_loss("grpo"), Dist(), SHARED)
        assert update.shared is not checkpointing
        assert update.options == SHARED and update.train_options.prefix_sharing is not checkpointing
        metrics = update(rows)
        assert metrics["optimizer_steps"] == 1
        after[checkpointing] = {n: p.detach().clone() for n, p in model.named_parameters()}
        layer_calls[checkpointing] = len(calls)
    micro_batches = 3  # 120-token budget, padded layout
    assert layer_calls[True] == 2 * micro_batches and layer_calls[False] > micro_batches  # + the shared heads
    moved = max(float((after[False][n] - before[n]).abs().max()) for n in before)
    assert moved > 1e-3  # the step is not trivially zero
    for n in before:
        # float32 rounding of weights near 1 (ulp 1.2e-7); a wrong gradient would differ by ~the step (> 1e-3)
        torch.testing.assert_close(after[True][n], after[False][n], atol=1e-6, rtol=0, msg=n)
