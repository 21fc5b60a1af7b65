"""What the state definition changes, on real ScienceWorld rollouts: the simulator's one-line reply (the key every
consumer read first), the room and the inventory (the state before the task's progress joined it) and the
environment's state now (the task's progress, the inventory, then the room: :func:`empo2.envs.base.state_of`).

    python benchmarks/states.py                       # writes records/benchmarks/states.json, prints a table
    python benchmarks/states.py --variations 2 --group 4 --steps 8     # quicker

Rollouts: a seeded random policy over the compact valid-action list (``focus on`` left out, so episodes run to the
step cap), G members per (task, variation), as a GRPO group would. Every key is read from the same steps.

- distinct keys per 100 steps;
- retrieval precision: every episode writes one tip keyed by its last step (as the reflection does); every step of
  every other episode of the task queries the tips (cosine ≥ ``--threshold``, top ``--top-k``, the memory's
  defaults); precision = share of retrieved tips written in the query's room (the namespace fixes the task);
- GiGPO anchor groups (steps of one episode group with the same key): their sizes, and the share of steps in a group
  that spans more than one room;
- MiniLM word pieces per distinct key, and the share of keys whose inventory lies past the embedder's 256;
- novelty reward per step (1/n, cosine ``--novelty-threshold``) of a scripted walk through new rooms and of one
  action repeated in place;
- the gold path of find-non-living-thing variation 0: whether the move after ``focus on`` answers the same key as
  the steps before the focus (the focus scores 50 and changes neither the room nor the inventory).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import subprocess
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from empo2.algo.empo2 import novelty_reward
from empo2.envs.base import state_of
from empo2.envs.scienceworld import ScienceWorldEnv
from empo2.envs.scienceworld.text import scienceworld_state
from empo2.memory.embedder import get_embedder
from empo2.memory.novelty import NoveltyReward

TASKS = ["find-animal", "find-living-thing", "find-non-living-thing", "lifespan-longest-lived"]
WALK = ["go to kitchen", "go to outside", "go to greenhouse", "go to hallway", "go to workshop"]
REPEAT = ["open door to kitchen"] * 5  # in the hallway: "The door is already open." every time
LOOK_IN_PLACE = ["look at picture", "look at agent", "inventory", "look at air", "open door to bedroom"]
"""Five actions in the hallway that change nothing there, each with another reply."""


KEYS = ("reply", "room", "state")
"""The keys compared: the reply, the room + inventory, the state with the task's progress."""
LABELS = {"reply": "reply", "room": "room + inventory (before)", "state": "progress + inventory + room (now)"}


def room_and_inventory(info: dict) -> str:
    """The state before the task's progress joined it: the room, then the inventory, listings sorted."""
    state = scienceworld_state(info["look"], "", 0)  # the room alone, listings sorted (the progress line dropped)
    room = state.split("\n", 1)[1]
    inventory = scienceworld_state("", info["inventory"], 0).split("\n", 1)[1]
    return f"{room}\n{inventory}"


def keys_of(obs: str, info: dict) -> dict:
    return {"reply": " ".join(obs.split()), "room": room_and_inventory(info), "state": state_of(obs, info),
            "room_name": room_of(info["look"])}


def room_of(look: str) -> str:
    match = re.search(r"called the ([^.]+)\.", look)
    return match.group(1) if match else "?"


def play(env: ScienceWorldEnv, task: str, variation: int, seed: int, steps: int) -> list[dict]:
    """One random episode; per step: the reply key (before), the state key (after), and the room, each for the
    situation the action answered and the one it reached."""
    rng = random.Random(seed)
    obs, info = env.reset(task, variation)
    here = keys_of(obs, info)
    out = []
    for _ in range(steps):
        choices = [a for a in env.short_valid_actions() if not a.startswith(("focus on", "reset", "eat", "mix"))]
        res = env.step(rng.choice(choices))
        there = keys_of(res.observation, res.info)
        out.append({"answered": here, "reached": there})
        here = there
        if res.done:
            break
    return out


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def retrieval_precision(episodes: list[dict], embed, key: str, k: int, threshold: float) -> dict:
    """Tips keyed by each episode's last answered situation; queries: every step of the task's other episodes.
    ``precision_at_1`` / ``precision``: share of the first / of all retrieved tips written in the query's room;
    ``base_rate``: share of the task's other tips written in the query's room (what a random pick would get)."""
    hits = total = queries = answered = top_hits = 0
    base = []
    by_task = defaultdict(list)
    for i, ep in enumerate(episodes):
        by_task[ep["task"]].append(i)
    for idx in by_task.values():
        tips = [(i, episodes[i]["steps"][-1]["answered"]) for i in idx if episodes[i]["steps"]]
        tip_vecs = unit(embed([t[key] for _, t in tips]))
        for i in idx:
            steps = episodes[i]["steps"]
            if not steps:
                continue
            q = unit(embed([s["answered"][key] for s in steps]))
            sims = q @ tip_vecs.T  # [steps, tips]
            for row, s in enumerate(steps):
                room = s["answered"]["room_name"]
                others = [j for j in range(len(tips)) if tips[j][0] != i]
                base.append(np.mean([tips[j][1]["room_name"] == room for j in others]) if others else 0.0)
                cand = [(sims[row, j], tips[j][1]["room_name"]) for j in others if sims[row, j] >= threshold]
                cand = sorted(cand, key=lambda c: -c[0])[:k]
                queries += 1
                if cand:
                    answered += 1
                    total += len(cand)
                    hits += sum(r == room for _, r in cand)
                    top_hits += cand[0][1] == room
    return {"precision_at_1": top_hits / answered if answered else None,
            "precision": hits / total if total else None, "base_rate": float(np.mean(base)),
            "queries_with_hits": answered / max(queries, 1), "tips_per_query": total / max(answered, 1)}


def anchor_groups(episodes: list[dict], key: str) -> dict:
    sizes, mixed_steps, steps_in_groups, n_steps = [], 0, 0, 0
    groups = defaultdict(list)
    for ep in episodes:
        for s in ep["steps"]:
            groups[(ep["task"], ep["variation"], s["answered"][key])].append(s["answered"]["room_name"])
            n_steps += 1
    for rooms in groups.values():
        sizes.append(len(rooms))
        if len(rooms) > 1:
            steps_in_groups += len(rooms)
            mixed_steps += len(rooms) * (len(set(rooms)) > 1)
    sizes = np.array(sizes)
    return {"groups": len(sizes), "mean_size": float(sizes.mean()), "max_size": int(sizes.max()),
            "singleton_share": float((sizes == 1).mean()), "steps_in_groups_of_2plus": steps_in_groups / n_steps,
            "steps_in_groups_mixing_rooms": mixed_steps / n_steps,
            "size_histogram": dict(sorted(Counter(int(s) for s in sizes).items()))}


def scripted_novelty(env: ScienceWorldEnv, embed, threshold: float) -> dict:
    out = {}
    for name, script in (("walk_new_rooms", WALK), ("repeat_in_place", REPEAT), ("look_in_place", LOOK_IN_PLACE)):
        env.reset("find-animal", 0)
        reached = {key: [] for key in KEYS}
        for action in script:
            res = env.step(action)
            for key, text in keys_of(res.observation, res.info).items():
                if key in reached:
                    reached[key].append(text)
        for key, texts in reached.items():
            rewards = novelty_reward(NoveltyReward(threshold).visits(np.asarray(embed(texts))))
            out[f"{name}/{key}"] = {"mean": float(rewards.mean()), "per_step": [round(float(r), 3) for r in rewards]}
    return out


def word_pieces(episodes: list[dict], key: str, tokenizer, limit: int) -> dict:
    """MiniLM word pieces of each distinct key (special tokens included), and the share of keys whose inventory
    starts past the embedder's ``limit`` (the embedder never reads it)."""
    texts = sorted({s["answered"][key] for ep in episodes for s in ep["steps"]})
    sizes, cut = [], 0
    for text in texts:
        sizes.append(len(tokenizer(text)["input_ids"]))
        at = text.find("In your inventory")
        cut += at >= 0 and len(tokenizer(text[:at])["input_ids"]) >= limit
    return {"keys": len(texts), "mean": float(np.mean(sizes)), "max": int(max(sizes)),
            "over_limit": float(np.mean([n > limit for n in sizes])), "inventory_past_limit": cut / len(texts)}


def focus_anchor(env: ScienceWorldEnv) -> dict:
    """The gold path of find-non-living-thing variation 0: does the move after ``focus on`` answer the same key as a
    step before the focus?"""
    cap, env.max_steps = env.max_steps, None  # the task's own cap (30): the gold path fits
    try:
        obs, info = env.reset("find-non-living-thing", 0)
        gold = env.gold_actions()
        answered = []
        for action in gold:
            answered.append(keys_of(obs, info))
            res = env.step(action)
            obs, info = res.observation, res.info
            if res.done:
                break
    finally:
        env.max_steps = cap
    focus = next(t for t, a in enumerate(gold) if a.startswith("focus on"))
    return {"gold": gold, **{key: any(answered[focus + 1][key] == a[key] for a in answered[: focus + 1])
                             for key in KEYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=TASKS)
    ap.add_argument("--variations", type=int, default=3, help="first N train variations per task")
    ap.add_argument("--group", type=int, default=8, help="episodes per variation (a GRPO group)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--novelty-threshold", type=float, default=0.9)
    ap.add_argument("--out", default="records/benchmarks/states.json")
    args = ap.parse_args()
    flags = subprocess.run("lscpu | grep -o -E 'avx2|avx512_bf16|amx_bf16' | sort -u | tr '\\n' ' '", shell=True,
                           capture_output=True, text=True).stdout.strip()
    embedder = get_embedder()
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        missing = sorted({t for t in texts if t not in cache})
        if missing:
            cache.update(zip(missing, np.asarray(embedder.encode(missing))))
        return np.stack([cache[t] for t in texts])

    t0 = time.perf_counter()
    episodes = []
    env = ScienceWorldEnv(max_steps=args.steps, valid_actions_in_info=False)
    try:
        for task in args.tasks:
            for variation in env.variations(task, "train")[: args.variations]:
                for member in range(args.group):
                    steps = play(env, task, variation, seed=zlib.crc32(f"{task}/{variation}/{member}".encode()), steps=args.steps)
                    episodes.append({"task": task, "variation": variation, "steps": steps})
        novelty = scripted_novelty(env, embed, args.novelty_threshold)
        focus = focus_anchor(env)
    finally:
        env.close()
    play_seconds = time.perf_counter() - t0
    n_steps = sum(len(ep["steps"]) for ep in episodes)
    result = {"machine": {"cpu_flags": flags, "python": platform.python_version()}, "args": vars(args),
              "episodes": len(episodes), "steps": n_steps, "play_seconds": round(play_seconds, 1),
              "rooms_visited": len({(ep["task"], s["answered"]["room_name"]) for ep in episodes for s in ep["steps"]})}
    limit = embedder.model.max_seq_length
    for key in KEYS:
        distinct = len({(ep["task"], s["answered"][key]) for ep in episodes for s in ep["steps"]})
        result[key] = {"distinct_per_100_steps": 100 * distinct / n_steps,
                       "retrieval": retrieval_precision(episodes, embed, key, args.top_k, args.threshold),
                       "anchor_groups": anchor_groups(episodes, key),
                       "word_pieces": word_pieces(episodes, key, embedder.model.tokenizer, limit)}
    result["novelty"] = novelty
    result["focus_anchor"] = focus
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"cpu flags: {flags}; {len(episodes)} episodes, {n_steps} steps, {result['rooms_visited']} (task, room) "
          f"pairs, {play_seconds:.0f} s")
    print(f"| measure | {' | '.join(LABELS[k] for k in KEYS)} |\n|---|{'---|' * len(KEYS)}")
    rows = [("distinct keys per 100 steps", lambda r: f"{r['distinct_per_100_steps']:.1f}"),
            ("retrieval: first tip from the query's room", lambda r: f"{r['retrieval']['precision_at_1']:.2f}"),
            (f"retrieval: top-{args.top_k} tips from the query's room", lambda r: f"{r['retrieval']['precision']:.2f}"),
            ("retrieval: the task's tips from the query's room", lambda r: f"{r['retrieval']['base_rate']:.2f}"),
            ("queries with ≥ 1 tip", lambda r: f"{r['retrieval']['queries_with_hits']:.2f}"),
            ("anchor groups: mean size", lambda r: f"{r['anchor_groups']['mean_size']:.2f}"),
            ("anchor groups: max size", lambda r: f"{r['anchor_groups']['max_size']}"),
            ("steps in anchor groups of ≥ 2", lambda r: f"{r['anchor_groups']['steps_in_groups_of_2plus']:.2f}"),
            ("steps in anchor groups mixing rooms", lambda r: f"{r['anchor_groups']['steps_in_groups_mixing_rooms']:.2f}"),
            (f"MiniLM word pieces per key: mean / max (limit {limit})",
             lambda r: f"{r['word_pieces']['mean']:.0f} / {r['word_pieces']['max']}"),
            ("keys longer than the limit", lambda r: f"{r['word_pieces']['over_limit']:.2f}"),
            ("keys whose inventory lies past the limit", lambda r: f"{r['word_pieces']['inventory_past_limit']:.2f}")]
    for name, fmt in rows:
        print(f"| {name} | {' | '.join(fmt(result[k]) for k in KEYS)} |")
    for name in ("walk_new_rooms", "repeat_in_place", "look_in_place"):
        cells = " | ".join(f"{novelty[f'{name}/{k}']['mean']:.2f}" for k in KEYS)
        print(f"| novelty per step, {name.replace('_', ' ')} | {cells} |")
    cells = " | ".join("same as before the focus" if focus[k] else "its own" for k in KEYS)
    print(f"| gold path of find-non-living-thing 0: the key of the move after `focus on` | {cells} |")


if __name__ == "__main__":
    main()
