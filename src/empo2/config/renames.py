"""Config keys that were renamed, and the path that keeps configs written with the old names loading.

A YAML file, a saved run's ``config.yaml`` or an override may still use an old name: it is read as the new one, with
one :class:`ConfigRenameWarning` per old name and load, and refused (exit 2) when the old and the new name are both
given with different values. A run saved with old names resumes: its checkpoints' stored settings are read through
:data:`RENAMED` too. A saved ``config.yaml`` is always written with the current names.

A method's settings were once flat fields of the ``algo`` section (``algo.proxmo_alpha``); each method now declares
its own, nested under its name (``algo.proxmo.alpha``). GiGPO's and ProxMO's shared discount and step weight became
one setting of each, so their old names set both. So were an environment's settings fields of the ``env`` section
(``env.twx_params``); each environment now declares its own, nested under its name
(``env.textworld_express.params``).
"""

from __future__ import annotations

import warnings

RENAMED: dict[str, str | tuple[str, ...]] = {
    "train.num_iterations": "train.ppo_epochs",
    "algo.delta": "algo.low_prob_threshold",
    "algo.gamma": ("algo.gigpo.gamma", "algo.proxmo.gamma"),
    "algo.step_advantage_weight": ("algo.gigpo.step_advantage_weight", "algo.proxmo.step_advantage_weight"),
    "algo.step_similarity": "algo.gigpo.step_similarity",
    "algo.gigpo_normalization": "algo.gigpo.normalization",
    **{f"algo.proxmo_{name}": f"algo.proxmo.{name}" for name in ("psc", "psa", "alpha", "range", "tau",
                                                                  "max_features")},
    **{f"algo.luffy_{name}": f"algo.luffy.{name}" for name in ("gamma", "shaping", "clip", "std")},
    "algo.elpo_lambda": "algo.elpo.lambda_tree",
    **{f"algo.elpo_{name}": f"algo.elpo.{name}" for name in ("eps_elc", "b_max", "x_min", "x_max", "beta")},
    "env.simplification": "env.scienceworld.simplification",
    **{f"env.webshop_{name}": f"env.webshop.{name}" for name in ("data", "human_goals", "num_products", "start")},
    "env.twx_params": "env.textworld_express.params",
    "env.twx_eval_params": "env.textworld_express.eval_params",
}
"""Old dotted name → current dotted name (or names, for an old setting that two methods now hold each)."""


class ConfigRenameWarning(UserWarning):
    """A config used a key's old name; it was read as the new one (the CLI prints it as one ``warning:`` line)."""


def new_names(old: str) -> tuple[str, ...]:
    """The current dotted names the old name ``old`` sets (or, for a folded one, reads into)."""
    new = RENAMED.get(old) or FOLDED[old]
    return (new,) if isinstance(new, str) else new


def old_name(key: str) -> str | None:
    """The old dotted name ``key`` stands for (renamed or folded), written dotted (``algo.delta``) or bare (``delta``)
    when only one old name ends so; ``None`` for any other key."""
    olds = [*RENAMED, *FOLDED]
    if key in olds:
        return key
    matches = [old for old in olds if old.split(".", 1)[1] == key]
    return matches[0] if len(matches) == 1 else None


def forward_flat(settings: dict) -> dict:
    """``{section.name: value}`` with old names replaced by the current ones (a checkpoint's stored settings)."""
    out = {}
    for key, value in settings.items():
        out.update(dict.fromkeys(new_names(key), value) if key in RENAMED else {key: value})
    return out


_WARNED: set[tuple[str, str]] = set()
"""(old name, source) pairs warned about in this process: a file read again (a resume reads its run's config twice,
a comparison reads its preset once per run) does not repeat its warnings."""


def warn_renamed(used: dict[str, str]) -> None:
    """One warning per old name, each saying where it was read: ``used`` maps an old dotted name to its source."""
    for old, where in used.items():
        if (old, where) in _WARNED:
            continue
        _WARNED.add((old, where))
        if old in RENAMED:
            new = " and ".join(new_names(old))
            message = f"{old} is now called {new}: {where} uses the old name, read as {new} (rename it there)"
        else:
            message = (f"{old} is now part of {FOLDED[old]}: {where} uses the old key, read into {FOLDED[old]} "
                       "(state it there)")
        warnings.warn(message, ConfigRenameWarning, stacklevel=3)
    used.clear()


FOLDED: dict[str, str] = {"train.tensorboard": "train.report_to"}
"""Old dotted name → the current key its value is folded into (:func:`fold_tensorboard`), once the other keys of its
source are set."""


def fold_tensorboard(report_to: list[str], tensorboard: bool) -> list[str]:
    """``train.report_to`` under the old ``train.tensorboard``: false leaves TensorBoard out (``none`` when no tracker
    is left); true changes nothing, since TensorBoard ran only where ``report_to`` named it."""
    return list(report_to) if tensorboard else [n for n in report_to if n != "tensorboard"] or ["none"]
