"""The paper's ablations as named arms: one :class:`Arm` per name, an algorithm plus the ``algo`` settings it fixes;
and what any arm runs, in words (:func:`arm_settings`: its reward, advantage and loss, and where it differs from
its method's official runs).

A config that names an arm (``algo.arm``) is checked at load (:func:`check_arm`): it must hold the arm's algorithm and
settings, so a label never says one thing while the run did another. The table lives here, below the config, because
the config checks it; :mod:`empo2.experiments.arm_runs` turns it into comparison runs and report labels. Nothing here
imports the config; it takes the ``algo`` section as an argument.

Arms differ in their method only: the novelty bonus is EMPO²'s (its ``AlgorithmSpec.novelty``), so every other
algorithm's arm runs without it unless its name says so (``grpo-novelty``, ``NAME+novelty``); every arm shares the
config's loss settings except those its method fixes (LUFFY's, ELPO's), and lists the official settings it does not
run (:func:`official_differences`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from empo2.algo.losses import settings_of
from empo2.algo.registry import get_algorithm


@dataclass(frozen=True)
class Arm:
    name: str
    algo: str
    """The ``algo.name`` the arm runs."""
    what: str
    """One line for ``compare --help`` and error messages."""
    settings: dict[str, Any] = field(default_factory=dict)
    """``algo`` settings the arm fixes, by their name under ``algo`` (``p_off_policy``, ``proxmo.psc``) -> value,
    besides ``advantage=grpo`` (:data:`ESTIMATOR`)."""
    needs_novelty: bool = False
    """The arm keeps the config's novelty bonus, so a config without one would run it under a false name."""
    needs_warm_start: bool = False
    """The arm starts from a warm start (``policy.warm_start``), which its name says."""

    def fixed(self) -> dict[str, Any]:
        """Every ``algo`` field the arm fixes."""
        return {"advantage": ESTIMATOR, **self.settings}

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides compare adds for this arm."""
        return [f"algo.name={self.algo}", *(f"algo.{k}={v}" for k, v in self.fixed().items()), f"algo.arm={self.name}"]


ESTIMATOR = "grpo"
"""Every arm's advantage estimator: a label without ``+gigpo`` never runs GiGPO's."""

NO_NOVELTY = {"intrinsic_weight": 0.0, "intrinsic_schedule": "constant"}
"""The novelty bonus off (the schedule too: under the linear schedule ``algo.intrinsic_weight`` is not read)."""

LUFFY_SETTINGS = {"luffy.shaping": True, "luffy.clip": False, "luffy.std": False, "loss_type": "dr_grpo",
                  **NO_NOVELTY}
"""The settings of LUFFY's official script that the ``luffy`` arms fix (no novelty bonus: LUFFY has none)."""


def setting(algo_cfg: Any, name: str) -> Any:
    """The value of ``algo.<name>``: a shared field (``beta``) or a method's own setting (``luffy.clip``)."""
    value = algo_cfg
    for part in name.split("."):
        value = getattr(value, part)
    return value


def novelty_on(algo_cfg: Any) -> bool:
    """Whether the episode novelty reward enters the return at some iteration."""
    if algo_cfg.intrinsic_schedule == "linear":
        return algo_cfg.intrinsic_weight_start > 0 or algo_cfg.intrinsic_weight_end > 0
    return algo_cfg.intrinsic_weight > 0


ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("empo2-no-offpolicy", "empo2", "EMPO² without the off-policy mode (algo.p_off_policy=0: every memory rollout "
        "trains with its tips)", {"p_off_policy": 0.0}),
    Arm("empo2-no-novelty", "empo2", "EMPO² without the intrinsic reward (algo.intrinsic_weight=0, constant schedule)",
        dict(NO_NOVELTY)),
    Arm("grpo-novelty", "grpo", "EMPO² without tips: GRPO with the config's novelty bonus (refused if it has none)",
        needs_novelty=True),
    Arm("grpo-no-novelty", "grpo", "plain GRPO: no tips, no intrinsic reward (algo.intrinsic_weight=0, constant "
        "schedule)", dict(NO_NOVELTY)),
    Arm("proxmo-no-psc", "proxmo", "ProxMO without its polarized signal controller: the episode advantage is "
        "unweighted (algo.proxmo.psc=false)", {"proxmo.psc": False, "proxmo.psa": True, **NO_NOVELTY}),
    Arm("proxmo-no-psa", "proxmo", "ProxMO without its proximity-weighted step advantage: A = the weighted episode "
        "advantage only (algo.proxmo.psa=false)", {"proxmo.psc": True, "proxmo.psa": False, **NO_NOVELTY}),
    # LUFFY as its official script runs it: Dr.GRPO aggregation, mean-only advantage, no on-policy clip, no mask
    Arm("luffy", "luffy", "LUFFY: one expert (gold-path) member per group, shaped expert tokens f(x)=x/(x+0.1), "
        "unclipped on-policy rows, mean-only advantage, Dr.GRPO aggregation", dict(LUFFY_SETTINGS)),
    Arm("luffy-no-shaping", "luffy", "LUFFY without policy shaping (f(x)=x: the mixed-policy objective)",
        {**LUFFY_SETTINGS, "luffy.shaping": False}),
    Arm("empo2+luffy", "empo2_luffy", "EMPO² with an expert member: tips, novelty and EMPO²'s loss on the sampled "
        "rows, LUFFY's shaped expert tokens in the same group"),
    Arm("elpo", "elpo", "ELPO with Table 2's settings (tree rollouts by binary error localisation, hierarchical "
        "advantages, ε_low 0.2 + ε_elc 0.115 on the critical suffix, ε_high 0.315; no intrinsic reward)",
        {"epsilon": 0.2, "epsilon_high": 0.315, "elpo.eps_elc": 0.115, "elpo.lambda_tree": 0.5, "elpo.b_max": 3,
         "elpo.x_min": 1.0, "elpo.x_max": 3.0, "elpo.beta": 5.0, **NO_NOVELTY}),
    Arm("warm-start", "frozen", "the warm start alone (policy.warm_start): it plays the budget's episodes, takes no "
        "update and is evaluated like the others", NO_NOVELTY, needs_warm_start=True),
    Arm("sft-grpo", "grpo", "SFT, then GRPO (LUFFY's baseline): plain GRPO from the warm start (policy.warm_start), "
        "no intrinsic reward", NO_NOVELTY, needs_warm_start=True),
)}
"""Every ablation arm, by name."""


def check_arm(algo_cfg: Any, warm_start: str | None = None) -> str | None:
    """The reason ``algo_cfg`` cannot carry its ``arm`` label, or ``None`` when it can (or names no arm);
    ``warm_start``: the config's ``policy.warm_start``."""
    if algo_cfg.arm is None:
        return None
    arm = ARMS.get(algo_cfg.arm)
    if arm is None:
        return f"algo.arm: unknown arm {algo_cfg.arm!r}; valid: {', '.join(ARMS)}"
    if algo_cfg.name != arm.algo:
        return f"algo.arm={arm.name} runs algo.name={arm.algo}, got {algo_cfg.name!r}"
    for key, value in arm.fixed().items():
        if setting(algo_cfg, key) != value:
            return f"algo.arm={arm.name} needs algo.{key}={value}, got {setting(algo_cfg, key)!r}"
    if arm.needs_novelty and not novelty_on(algo_cfg):
        return (f"algo.arm={arm.name} keeps the config's novelty bonus, but it has none (algo.intrinsic_weight=0); "
                "set algo.intrinsic_weight > 0 or run plain grpo")
    if arm.needs_warm_start and not warm_start:
        return (f"algo.arm={arm.name} starts from a warm start, but policy.warm_start is empty; make one with "
                "`empo2 sft` and name its run folder there")
    return None


# ----------------------------------------------------------------------------------------------- what an arm runs
def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def reward_text(algo_cfg: Any) -> str:
    """The arm's reward function in words: the environment's return, the novelty bonus where it is on, an expert
    member, ELPO's path returns."""
    spec = get_algorithm(algo_cfg.name)
    text = "the environment's return (its score changes)"
    if novelty_on(algo_cfg):
        weight = (f"{algo_cfg.intrinsic_weight_start:g} → {algo_cfg.intrinsic_weight_end:g} (linear)"
                  if algo_cfg.intrinsic_schedule == "linear" else f"{algo_cfg.intrinsic_weight:g}")
        text += f" + {weight} × novelty 1/n ({algo_cfg.intrinsic_aggregation} over the episode's steps)"
    else:
        text += ", no novelty bonus"
    if spec.expert_members:
        text += f"; {spec.expert_members} gold-path member(s) per group, inside the group's baseline"
    if spec.reward_note:
        text += f"; {spec.reward_note}"
    return text


def advantage_text(algo_cfg: Any) -> str:
    """The arm's advantage estimator and its knobs, in words."""
    a, name = algo_cfg, get_algorithm(algo_cfg.name).estimator(algo_cfg)
    if name == "grpo":
        return "GRPO, " + ("÷ group std" if a.scale_rewards else "mean-only")
    if name == "gigpo":
        g = a.gigpo
        return f"GiGPO {g.normalization}, γ {g.gamma:g}, ω {g.step_advantage_weight:g}"
    if name == "proxmo":
        p = a.proxmo
        psc = f"PSC α {p.alpha:g} ±{p.range:g}" if p.psc else "no PSC"
        psa = f"PSA τ {p.tau:g}" if p.psa else "no PSA"
        return f"ProxMO, {psc}, {psa}, γ {p.gamma:g}, ω {p.step_advantage_weight:g}"
    if name == "luffy":
        return "LUFFY Eq. 4, " + ("÷ group std" if a.luffy.std else "mean-only")
    if name == "elpo":
        return f"ELPO A_hier, λ {a.elpo.lambda_tree:g}"
    return name


def official_differences(algo_cfg: Any) -> list[str]:
    """Where the run differs from its method's official runs (``AlgorithmSpec.official``), one item per setting."""
    out = []
    for key, value in get_algorithm(algo_cfg.name).official[1].items():
        if key == "entropy_coeff":
            out.append(f"entropy bonus {value:g} there, none here (empo2's losses have no entropy term)")
        elif setting(algo_cfg, key) != value:
            out.append(f"{key} {_fmt(setting(algo_cfg, key))} (official {_fmt(value)})")
    return out


def arm_settings(algo_cfg: Any) -> dict[str, Any]:
    """What a run of ``algo_cfg`` trains on, in words (``compare`` prints it at the start and stores it in the
    summary): ``reward``, ``advantage``, ``loss`` (the settings the loss applies, :func:`empo2.algo.losses.settings_of`),
    ``official`` (the source of its method's official settings, or "") and ``differs_from_official``."""
    spec = get_algorithm(algo_cfg.name)
    return {"reward": reward_text(algo_cfg), "advantage": advantage_text(algo_cfg),
            "loss": settings_of(spec.loss, algo_cfg) if spec.updates_weights else {"loss": "none (no update)"},
            "official": spec.official[0],
            "differs_from_official": official_differences(algo_cfg)}


def settings_line(name: str, settings: dict[str, Any]) -> str:
    """One arm's :func:`arm_settings` on one line."""
    loss = settings["loss"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in loss.items() if k != "loss")
    line = (f"{name}: reward = {settings['reward']}; advantage = {settings['advantage']}; "
            f"loss = {loss['loss']} ({parts})")
    if settings["differs_from_official"]:
        line += f"; differs from {settings['official']}: {'; '.join(settings['differs_from_official'])}"
    return line
