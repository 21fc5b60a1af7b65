"""Chain packing in the warm start (``empo2 sft``): batches keep a chained episode whole (and are cut as before where
nothing chains), and a step plans its packing once and moves the weights by the float64 gradient of the rows' NLL.

The trainer is built without a model load, a worker pool or a run folder (``object.__new__``, then the attributes
``batches`` and ``step`` read): these tests concern the batching and the step only, on the tiny models of the
packing tests.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import empo2.sft.sft_trainer as sft_trainer
from empo2.config import Config
from empo2.policy import prefix as px
from empo2.policy.packing import plan_packing
from empo2.policy.seeded import row_seed
from empo2.sft.demos import DemoRow, Demos
from empo2.sft.sft_trainer import SFTTrainer
from test_packed_update import HEAD, UNPACKED, count_plans, episodes
from test_prefix_sharing import Tok, tiny_lm

PACKED = px.ComputeOptions(min_shared_tokens=8)
SIZE = 4  # sft.batch_rows: episodes of 3 rows straddle it


def _demo_rows(seed: int, chained: bool = True, count: int = 5) -> list[DemoRow]:
    """``count`` gold episodes of 3 steps, listed episode by episode as the demonstrations are. ``chained``: the
    ``append`` layout; else each prompt's tail after the head is reversed, so that no row extends another (as in
    the ``window`` layout, which renders each step afresh)."""
    prompts, targets, episode = episodes(seed, count=count, steps=3)
    if not chained:
        prompts = [p[:HEAD] + p[HEAD:][::-1] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (episode[i], i))
    return [DemoRow(prompts[i], targets[i], "act", "task", episode[i], episode[i]) for i in order]


def _trainer(model, rows: list[DemoRow], options: px.ComputeOptions = PACKED, *overrides: str) -> SFTTrainer:
    sft = object.__new__(SFTTrainer)
    sft.cfg = Config.load("configs/scienceworld_cpu.yaml", [f"sft.batch_rows={SIZE}", "train.max_grad_norm=1e9",
                                                            *overrides])
    sft.model, sft.tokenizer, sft.options, sft.shared = model, Tok(), options, options.prefix_sharing
    sft.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sft.demos = Demos(rows, [], [])
    return sft


def _old_batches(rows: list[DemoRow], seed: int, epoch: int, size: int) -> list[list[DemoRow]]:
    """The cut before chains were kept whole: the episodes in the seeded shuffle, their rows every ``size``."""
    by_episode: dict[int, list[DemoRow]] = {}
    for row in rows:
        by_episode.setdefault(row.episode, []).append(row)
    order = sorted(by_episode)
    random.Random(row_seed(seed, epoch)).shuffle(order)
    flat = [row for e in order for row in by_episode[e]]
    return [flat[k:k + size] for k in range(0, len(flat), size)]


def _ids(batches) -> list[list[int]]:
    return [[id(r) for r in b] for b in batches]


def test_chained_episodes_stay_whole_in_the_batch_their_first_row_falls_in():
    rows = _demo_rows(0)
    sft = _trainer(tiny_lm(0), rows)
    for epoch in range(1, 5):
        old = _old_batches(rows, sft.cfg.sft.seed, epoch, SIZE)
        flat = [r for b in old for r in b]
        assert any(len({k for k, b in enumerate(old) for r in b if r.episode == e}) > 1 for e in range(5))  # split
        starts = {}  # each episode's first row's place in the shuffled order: its batch is that place // SIZE
        for k, r in enumerate(flat):
            starts.setdefault(r.episode, k)
        want = [[r for r in flat if starts[r.episode] // SIZE == b] for b in range(len(flat) // SIZE + 1)]
        assert _ids(sft.batches(epoch)) == _ids([b for b in want if b])


@pytest.mark.parametrize(("chained", "options"), [(False, PACKED), (True, UNPACKED)])
def test_batches_are_cut_as_before_where_nothing_chains(chained, options):
    """The ``window`` layout's rows (nothing chains), or chained rows without packing: every ``sft.batch_rows``."""
    rows = _demo_rows(1, chained=chained)
    assert plan_packing([r.prompt for r in rows], [r.target for r in rows]).packs is chained
    sft = _trainer(tiny_lm(0), rows, options)
    for epoch in range(1, 5):
        assert _ids(sft.batches(epoch)) == _ids(_old_batches(rows, sft.cfg.sft.seed, epoch, SIZE))


def test_a_step_plans_its_packing_once_and_moves_by_the_float64_gradient(monkeypatch):
    """One SGD(lr=1) step over two chained episodes, a micro-batch each: one packing plan for the step's heads and
    micro-batches, and the weights move by the float64 gradient of the mean NLL over the target tokens."""
    calls = count_plans(monkeypatch, sft_trainer)
    model = tiny_lm(2)
    batch = _demo_rows(2, count=2)
    ref = copy.deepcopy(model).double()
    nll = torch.zeros((), dtype=torch.float64)
    for r in batch:
        logits = ref(torch.tensor([r.prompt + r.target])).logits[0, len(r.prompt) - 1:-1]  # [T, V]
        nll = nll - torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.target)[:, None]).sum()
    (nll / sum(len(r.target) for r in batch)).backward()
    nll = float(nll.detach())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total, tokens, ok = _trainer(model, batch, PACKED, "train.micro_batch_tokens=1").step(batch)
    assert ok and calls == [len(batch), 3, 3]  # the step's plan, then each micro-batch's (one packed sequence)
    assert tokens == sum(len(r.target) for r in batch) and abs(total - nll) < 1e-4 * nll
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    assert scale > 1e-3
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close((before[n] - p.detach()).double(), q.grad, atol=1e-5 * scale, rtol=1e-4, msg=n)
