"""The ``empo2`` command re-executes itself on jemalloc when the machine has it (``empo2.allocator``)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

from empo2 import allocator

PROBE = "from empo2.allocator import reexec_with_jemalloc, active; reexec_with_jemalloc(); print(active())"


def probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "EMPO2_ALLOCATOR")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_preload_env_rules():
    assert allocator.preload_env({"PATH": "/bin"}, None) is None  # no library: nothing to do
    assert allocator.preload_env({"PATH": "/bin"}, "libjemalloc.so.2") == {
        "PATH": "/bin", "LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": allocator.MALLOC_CONF}
    assert allocator.preload_env({"MALLOC_CONF": "narenas:1"}, "lib.so")["MALLOC_CONF"] == "narenas:1"  # user's own
    assert allocator.preload_env({"LD_PRELOAD": "libx.so"}, "libjemalloc.so.2")["LD_PRELOAD"] == \
        "libjemalloc.so.2 libx.so"  # other preloads are kept
    assert allocator.preload_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "libjemalloc.so.2") is None  # no loop
    assert allocator.preload_env({"EMPO2_ALLOCATOR": "system"}, "libjemalloc.so.2") is None  # opted out


def test_a_process_reexecutes_on_jemalloc_when_the_machine_has_it():
    expected = "jemalloc" if allocator.jemalloc_library() else "system"  # scripts/setup.sh installs it as root
    assert probe() == expected
    assert probe(EMPO2_ALLOCATOR="system") == "system"
    assert allocator.active() == ("jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "system")


def test_the_console_script_goes_through_the_allocator_entry():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "empo2"]
    assert script.value == "empo2.cli:entry"
