"""``frontier``'s ablations (issue 41, part 4: "if LoGRA trails, try the cheapest changes that
could close it"), fixed 2026-12-07 before any ran. On the addition task LoGRA's frontier
trails the paper recipe's at KL-from-init 0.001-0.005 (3 seeds, bootstrap intervals below 0),
so each change below runs alone, on top of the protocol's LoGRA run at budget ``BUDGET``
(the step size LoGRA's frontier takes at KL 0.005), on seeds ``SEEDS``. Each is compared at
equal KL from init with that default run (same seed, paired per prompt) and with the paper
recipe's frontier:

- ``budget_warmup``: the budget rises from 0.1x to 1x over the first 4 updates (the cosine
  schedule run upwards: ``kl_budget`` 0.1x, ``kl_budget_final`` 1x, ``schedule_steps`` 5), as
  the paper recipe's lr warms up over 9 steps.
- ``length_reference``: the authors' newer length-normalised advantage
  (``loss.response_length_reference``: 16, the task's ``max_new_tokens``).
- ``rank_128``, ``rank_256``: the projections' rank (``rank: auto`` takes 64 at 135M).
- ``fixed_projections``: the first projections kept for the whole run (the paper redraws them
  after every update).
- ``early_validation``, a measurement rather than a change: the default setting for 4 steps,
  validated after each (its validations draw samples, so its later steps' rollouts differ
  from the default run's; the comparison is of the setting, not of one trajectory). The
  frontier interpolates linearly in KL between the untrained model and a run's first
  validation (step 4); where pass@1 rises faster than linearly in KL, that chord understates
  the run at small KL, and the paper recipe's warm-up gives it validations there that the
  default LoGRA run does not have.

Not run: the probe's tangent products in float32. This machine computes in float32, so the
probe's products are float32 already; that ablation is the default here (it matters in bf16).
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from .frontier_protocol import LABELS, LEVELS, at_level, frontier_point, path_of, runs_of, step_kl_figures, untrained_of
from .paired_stats import paired_points

TASK, BUDGET, SEEDS = "addition", 2.15e-3, (0, 1, 2)
LOGRA = "--trainer.strategy.init_args.logra"


class Ablation(NamedTuple):
    label: str
    overrides: list[str]  # on top of the LoGRA run at BUDGET
    steps: int | None = None  # None: the protocol's
    val_every: int | None = None


ABLATIONS = {
    "budget_warmup": Ablation("budget warm-up, 0.1x to 1x over 4 updates",
                              [f"{LOGRA}.kl_budget={BUDGET / 10:g}", f"{LOGRA}.kl_budget_final={BUDGET:g}",
                               f"{LOGRA}.schedule_steps=5"]),
    "length_reference": Ablation("response_length_reference 16", ["--model.init_args.loss.response_length_reference=16"]),
    "rank_256": Ablation("rank 256", [f"{LOGRA}.rank=256"]),
    "early_validation": Ablation("default, validated after each of 4 steps", [], steps=4, val_every=1),
    "rank_128": Ablation("rank 128", [f"{LOGRA}.rank=128"]),
    "fixed_projections": Ablation("projections never redrawn", [f"{LOGRA}.redraw_projections=false"]),
}
COMPARED_LEVELS = tuple(level for level in LEVELS if level <= 2e-2)


def ablation_runs(result: dict, name: str) -> dict[int, dict]:
    return {r["seed"]: r for r in result["runs"]
            if r["task"] == TASK and r["kind"] == "ablation" and r.get("ablation") == name}


def summarise_ablations(result: dict) -> list[dict]:
    """Per ablation with runs: its runs' figures and, at each level it reaches on every seed
    it ran, its difference from the default run at ``BUDGET`` and from the paper recipe's
    frontier (on the same seeds)."""
    untrained = untrained_of(result, TASK)
    default = {r["seed"]: r for r in runs_of(result, TASK, "logra", BUDGET)}
    summaries = []
    for name, ablation in ABLATIONS.items():
        runs = ablation_runs(result, name)
        seeds = sorted(s for s in runs if s in default and s in untrained)
        if not seeds:
            continue
        summary = {"ablation": name, "label": ablation.label, "seeds": seeds,
                   "final_pass_at_1": statistics.mean(runs[s]["validations"][-1]["pass_at_1"] for s in seeds),
                   "default_final_pass_at_1": statistics.mean(default[s]["validations"][-1]["pass_at_1"] for s in seeds),
                   "final_kl_from_init": statistics.median(runs[s]["validations"][-1]["kl_from_init"] for s in seeds),
                   **step_kl_figures([runs[s] for s in seeds]), "levels": {}}
        for level in COMPARED_LEVELS:
            ablated = [at_level(path_of(runs[s], untrained[s]), level) for s in seeds]
            baseline = [at_level(path_of(default[s], untrained[s]), level) for s in seeds]
            paper = frontier_point(result, TASK, "dense_paper", level, seeds)
            if any(values is None for values in ablated + baseline) or paper is None:
                continue
            summary["levels"][level] = {"minus_default": paired_points(ablated, baseline),
                                        "minus_paper": paired_points(ablated, paper["per_seed"]),
                                        "default_minus_paper": paired_points(baseline, paper["per_seed"])}
        summaries.append(summary)
    return summaries


def _difference(stats: dict) -> str:
    low, high = stats["t_points"]
    t = "" if low is None else f" [{low:+.1f}, {high:+.1f}]"
    b_low, b_high = stats["bootstrap_points"]
    return f"{stats['difference_points']:+.1f}{t} [{b_low:+.1f}, {b_high:+.1f}]"


def render_ablations(result: dict) -> list[str]:
    summaries = summarise_ablations(result)
    if not summaries:
        return []
    lines = [f"### Ablations: LoGRA at budget {BUDGET:g} on {TASK}, one change each", "",
             "| ablation | seeds | final pass@1 (mean; default's) | KL from init, final (median) | "
             "step KL (median over steps that moved) | steps that did not move |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {s['label']} | {', '.join(map(str, s['seeds']))} | {s['final_pass_at_1']:.3f} "
              f"({s['default_final_pass_at_1']:.3f}) | {s['final_kl_from_init']:.2e} | {s['median_step_kl']:.2e} | "
              f"{s['steps_still']} of {s['steps']} |" for s in summaries]
    lines += ["", f"At equal KL from init (points; t interval over seeds, then bootstrap over seeds and prompts): "
              f"each ablation minus the default run at budget {BUDGET:g}, minus the {LABELS['dense_paper']}'s "
              f"frontier, and the default run minus that frontier on the same seeds:", "",
              f"| KL from init | ablation | minus default | minus {LABELS['dense_paper']} | default minus "
              f"{LABELS['dense_paper']} |", "|---:|---|---|---|---|"]
    for s in summaries:
        lines += [f"| {level:g} | {s['label']} | {_difference(stats['minus_default'])} | "
                  f"{_difference(stats['minus_paper'])} | {_difference(stats['default_minus_paper'])} |"
                  for level, stats in s["levels"].items()]
    return lines + [""]
