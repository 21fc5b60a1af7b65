"""Presets that inherit: a YAML preset may name, under a top-level ``base:`` key, the preset it overrides (a path
relative to the preset's own file), and then states only what differs::

    # configs/scienceworld_evidence_cpu.yaml
    base: scienceworld_learn_cpu.yaml
    env: {eval_split: test, eval_variations: 20}
    train: {learning_rate: 1.0e-3}

The chain is applied from its root: the defaults, then each base, then the preset, key by key, so a section merges
with its base's and a value (a list, a mapping) replaces its base's value whole. A run's saved ``config.yaml`` is
the fully resolved config with no ``base:``, so a run folder never depends on the preset files it started from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from empo2.config.bounds_check import ConfigError, shown

BASE_KEY = "base"


def preset_layers(path: Path, read: Callable[[Path], dict[str, Any]]) -> list[tuple[Path, dict[str, Any]]]:
    """``(file, sections)`` of the preset at ``path`` and of every base it names, the root base first; ``read``
    parses one file into its mapping. A base that is missing, or a chain that comes back to a file it has passed,
    is a :class:`ConfigError`."""
    layers: list[tuple[Path, dict[str, Any]]] = []
    seen: list[Path] = []
    current: Path | None = path
    while current is not None:
        seen.append(current.resolve())
        data = dict(read(current))
        base = data.pop(BASE_KEY, None)
        layers.append((current, data))
        current = None if base is None else _base_path(layers[-1][0], base, seen)
    return layers[::-1]


def _base_path(preset: Path, base: Any, seen: list[Path]) -> Path:
    """The file ``base:`` names in ``preset``, checked: a string, an existing file, not one already in the chain."""
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{preset}: {BASE_KEY} must be the path of a preset file, got {shown(base)}")
    path = preset.parent / base.strip()
    if not path.is_file():
        raise ConfigError(f"{preset}: its {BASE_KEY} preset {base.strip()!r} is not a file ({path})")
    if path.resolve() in seen:
        chain = " -> ".join(p.name for p in [*seen, path.resolve()])
        raise ConfigError(f"{preset}: presets inherit in a circle ({chain}); one of them must not name a base")
    return path
