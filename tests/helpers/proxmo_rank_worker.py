"""ProxMO advantages of a fixed batch on this rank's groups, gathered through real collectives: run by
tests/test_proxmo.py as a plain process and under torchrun (2 gloo ranks).

usage: python tests/helpers/proxmo_rank_worker.py OUT   (writes OUT on one process, OUT.<rank> under torchrun)
"""

from __future__ import annotations

import json
import sys

import numpy as np

from empo2.algo.advantages import AdvantageInput, compute_advantages
from empo2.config import algo_config
from empo2.parallel import distributed as dp

TEXTS = ["You are in the kitchen. A fridge is here.", "You are in the hallway. A door leads north.",
         "A garden with an open gate.", "Search results: red shoes, blue shoes; page 1"]


def main(out: str) -> None:
    dist = dp.init_from_env()
    rng = np.random.default_rng(3)
    episodes = []  # (global index, group, step rewards, state texts, success), the same on every process
    for i in range(20):
        length = int(rng.integers(1, 5))
        episodes.append((i, i // 4, rng.choice([0.0, 10.0, 100.0], size=length),
                         [TEXTS[int(k)] for k in rng.integers(len(TEXTS), size=length)], bool(rng.random() < 0.4)))
    mine = [e for e in episodes if dist.owns(e[1])]  # rank r: groups r, r + W, …
    inp = AdvantageInput(np.array([e[2].sum() for e in mine]), np.array([e[1] for e in mine]), [e[2] for e in mine],
                         [e[3] for e in mine], algo_config(), np.array([e[4] for e in mine]), dist.all_gather)
    adv, _ = compute_advantages("proxmo", inp)
    path = f"{out}.{dist.rank}" if dist.enabled else out
    with open(path, "w") as f:
        json.dump({str(e[0]): a.tolist() for e, a in zip(mine, adv)}, f)
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
