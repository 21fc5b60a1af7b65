"""``empo2 play``: one episode through the same rollout code as training, with a gold, random or model policy,
printed as a transcript and a JSON result line."""

from __future__ import annotations

import json
import random

from empo2.config import Config, ConfigError, PolicyConfig


def play(args) -> int:
    """One episode through the same rollout code as training, with a gold, random or model policy."""
    from rich.console import Console

    from empo2.envs.factory import make_env_kwargs, resolve_tasks
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import RolloutContext, run_episodes
    from empo2.policy.sampling import Sampling

    console = Console(stderr=True, soft_wrap=True)
    overrides = [f"env.name={args.env}", f"env.seed={args.seed}"]
    overrides += [f"env.max_steps={args.max_steps}"] if args.max_steps else []
    overrides += [f"env.webshop.data={args.webshop_data}"] if args.webshop_data else []
    overrides += [f"env.webshop.start={args.webshop_start}"] if args.webshop_start else []
    cfg = Config.load(None, overrides + ([f"env.tasks=[{args.task}]"] if args.task else []))
    task = resolve_tasks(cfg.env)[0]
    model = tokenizer = None
    if args.policy == "model":  # load the model before starting the simulator: a bad name fails fast
        from empo2.policy.loader import load_model

        model, tokenizer = load_model(args.model, device=args.device)
    pcfg = PolicyConfig(history_window=args.history_window, max_completion_length=args.max_new_tokens,
                        max_prompt_length=2048)
    scripted, show = _scripted_policy(args), _transcript(console, args, task)
    with EnvPool(cfg.env.name, make_env_kwargs(cfg.env), 1) as pool:
        ctx = RolloutContext(model, tokenizer, pool, None, None, cfg.env.name, pcfg, cfg.memory)
        episodes, _ = run_episodes(ctx, [(task, args.variation, 0, "on")],
                                   Sampling.rollout(pcfg, temperature=args.temperature),
                                   actions=None if args.policy == "model" else scripted, on_step=show)
    ep = episodes[0]
    if ep.failed:
        raise ConfigError(f"the episode failed: {ep.error}")
    print(json.dumps({"task": task, "variation": args.variation, "score": ep.score, "success": ep.success,
                      "steps": len(ep.steps)}))
    return 0


def _scripted_policy(args):
    """The gold or random policy: it asks the environment for an action, not the model."""
    from empo2.policy.generate import Generation

    rng = random.Random(args.seed)

    def scripted(ctx, workers, episodes, prompts):
        worker, done = workers[0], len(episodes[0].steps)
        if args.policy == "gold":
            gold = ctx.pool.call(worker, "gold_actions")
            action = gold[done] if done < len(gold) else "look around"
        else:
            action = rng.choice(ctx.pool.call(worker, "valid_actions"))
        return [Generation(ids=[], logprobs=[], text=action)]

    return scripted


def _transcript(console, args, task: str):
    """Prints each step as it happens: the action (and what the model wrote, when it was corrected), then what the
    environment answered."""
    from rich.markup import escape

    def show(ep) -> None:
        step = ep.steps[-1]
        if len(ep.steps) == 1:
            console.rule(f"{args.env} · {task} · variation {args.variation} · policy {args.policy}")
            console.print(f"[bold]Task:[/bold] {escape(ep.task_description)}")
        fixed = f"  [dim](model wrote: {escape(repr(step.raw_action))})[/dim]" if step.action != step.raw_action else ""
        console.print(f"[bold cyan]> {escape(step.action)}[/bold cyan]{fixed}")
        console.print(f"{escape(step.observation.strip()[:600])}  [dim](reward {step.reward:+g}, score {ep.score:g})"
                      "[/dim]")

    return show
