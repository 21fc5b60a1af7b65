"""Where a run computed: ``machine.jsonl`` in the run folder gets one line at each start and resume.

The runs of one comparison may be spread over machines (a long protocol continued on another day or host). Float32
kernels round differently on CPUs with other vector units and at other thread counts, so the same seed can sample
other episodes there; this record lets a reader see which runs shared a kind of machine and a code version.
:data:`FIXES` names what, beside the config, its seed and the code, decides a run's numbers; :func:`differences`
says where runs that are compared draw for draw differ in it.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from empo2.policy.precision import ISA_FLAGS, cpu_flags

RECORD = "machine.jsonl"
FIXES = ("torch_threads", "kernel", "torch", "transformers")
"""What a run's numbers depend on besides its config, seed and code: torch's intra-op threads (a float32 reduction
split another way sums in another order), the CPU kernel path torch dispatched to (``ATEN_CPU_CAPABILITY``: AVX2 and
AVX512 kernels round differently), and the torch and transformers versions. Two runs equal in all of these and in
config, seed and code are equal bit for bit; runs that differ in one part at their first update or embedding."""


def describe() -> dict[str, Any]:
    """This process's machine: CPU model and vector flags, cores it may use, torch's threads and build, the GPU (if
    any) and the code version."""
    import torch
    import transformers

    from empo2.version import __version__

    flags = cpu_flags() or set()
    return {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "kernel": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "empo2": __version__, "commit": source_commit()}


def record(run_dir: Path, event: str) -> dict[str, Any]:
    """Append this machine, tagged ``event`` (``start`` or ``resume``), to the run folder's record; returns it."""
    entry = {"event": event, **describe()}
    with (Path(run_dir) / RECORD).open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The run folder's record, oldest first (empty for a run made before it existed)."""
    path = Path(run_dir) / RECORD
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def differences(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Where runs meant to draw alike (run name → its ``machine.jsonl`` entries) differ in :data:`FIXES`: one text per
    differing key, ``kernel AVX512 (a-seed1) vs AVX2 (b-seed1)``. A value a run did not record (a run from before it
    was recorded) is not counted; a run resumed under another value differs from itself."""
    found = []
    for key in FIXES:
        where: dict[str, list[str]] = {}
        for name, entries in runs.items():
            for value in dict.fromkeys(str(e[key]) for e in entries if e.get(key) is not None):
                where.setdefault(value, []).append(name)
        if len(where) > 1:
            found.append(f"{key} " + " vs ".join(f"{v} ({', '.join(names)})" for v, names in where.items()))
    return found


def short(entry: dict[str, Any]) -> str:
    """One machine in a table cell: ``AMD EPYC avx512_bf16 ×1`` (the widest vector flag, torch threads), then the
    GPU if the machine has one."""
    widest = entry["isa"][-1] if entry.get("isa") else "no-avx2"
    gpu = f" + {entry['gpu']}" if entry.get("gpu") else ""
    return f"{entry.get('cpu') or '?'} {widest} ×{entry.get('torch_threads', '?')}{gpu}"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def source_commit(package: Path = Path(__file__).parent) -> str | None:
    """The commit of the checkout this package runs from, ``+changes`` when the package's own files differ from it
    (not the rest of the tree: a comparison continued in a checkout changes its tracked results); ``None`` for an
    installed wheel, also one installed into a virtual environment inside some other git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() / "src" / "empo2" != package.resolve():
            return None  # not this project's own checkout
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None  # a repository without commits
        changed = bool(git("status", "--porcelain", "--", ".").stdout.strip())  # edited or new files
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+changes" if changed else "")
