"""What ``frontier`` reports, per task: each method's frontier at the KL levels (gain over the
untrained model, with intervals), the paired differences there, the sweep runs and the long
runs (``summarise``), as Markdown (``render``) and plots with seed bands (``plot``). The
protocol and the frontier arithmetic are ``frontier_protocol``'s."""

from __future__ import annotations

import statistics
from pathlib import Path

from .frontier_protocol import (LABELS, LEVELS, LONG_REWARD_LEVELS, LONG_REWARD_WINDOW, METHODS, PAIRS, SWEEPS, TARGETS,
                                TASKS, VAL_SAMPLES, chosen_value, frontier_point, runs_of, step_kl_figures, steps_to_reward,
                                trailing_means, untrained_of)
from .frontier_ablations import render_ablations
from .harness import code_line, cpu_caption, machine_line, pyplot, save_figure
from .paired_stats import paired_points, seed_mean, seeds_bootstrap_interval

COLOURS = {"dense": "tab:blue", "dense_paper": "tab:purple", "lora": "tab:orange", "logra": "tab:green"}


def method_seeds(result: dict, task: str, method: str) -> list[int]:
    """The seeds with an untrained validation and every sweep run of ``method``: its frontier
    is drawn on these, and a pair compared on the seeds both methods have."""
    return [s for s in sorted(untrained_of(result, task))
            if all(any(r["seed"] == s for r in runs_of(result, task, method, v)) for v in SWEEPS[method])]


def shared_prompts(result: dict, task: str, seeds: list[int]) -> bool:
    untrained = untrained_of(result, task)
    return len({untrained[s]["prompts_digest"] for s in seeds}) == 1


def gains_at(result: dict, task: str, method: str, level: float, seeds: list[int]) -> tuple[dict | None, list[list[float]]]:
    """The method's frontier point at ``level`` on ``seeds`` and each seed's per-prompt gain
    over the untrained model there (empty when the point is not reached)."""
    point = frontier_point(result, task, method, level, seeds) if seeds else None
    if point is None:
        return None, []
    untrained = untrained_of(result, task)
    return point, [[v - c / VAL_SAMPLES for v, c in zip(values, untrained[s]["correct"])]
                   for s, values in zip(seeds, point["per_seed"])]


def timing_of(result: dict, task: str) -> dict[str, float]:
    """Each method's seconds per step on ``task``, timed alone (``--timing``)."""
    return {r["method"]: r["step_s"] for r in result["runs"] if r["task"] == task and r["kind"] == "timing"}


def summarise(result: dict, task: str) -> dict:
    seeds_of = {m: method_seeds(result, task, m) for m in METHODS}
    untrained = untrained_of(result, task)

    def crossed(seeds: list[int]) -> bool:
        return len(seeds) > 1 and shared_prompts(result, task, seeds)

    levels = {}
    for level in LEVELS:
        methods = {}
        for method in METHODS:
            point, gains = gains_at(result, task, method, level, seeds_of[method])
            if point is not None:
                methods[method] = {"value": point["value"], "pass_at_1": point["pass_at_1"], "seeds": seeds_of[method],
                                   "gain_points": 100 * seed_mean(gains),
                                   "gain_interval_points": [100 * x for x in seeds_bootstrap_interval(gains, crossed=crossed(seeds_of[method]))]}
        pairs = {}
        for first, second in PAIRS:
            seeds = [s for s in seeds_of[first] if s in seeds_of[second]]
            (point_first, gains_first), (point_second, gains_second) = (gains_at(result, task, m, level, seeds)
                                                                        for m in (first, second))
            if point_first is None or point_second is None:
                continue
            difference = paired_points(point_first["per_seed"], point_second["per_seed"], crossed=crossed(seeds))
            low, high = difference["bootstrap_points"]
            gain_first, gain_second = 100 * seed_mean(gains_first), 100 * seed_mean(gains_second)
            ratio = gain_first / gain_second if gain_second > 0 else None
            pairs[f"{first}-{second}"] = {
                "seeds": seeds, **difference, "gain_ratio": ratio,
                "met": (ratio is not None and ratio >= TARGETS["gain_ratio"])
                       or (low <= 0 <= high and high - low <= TARGETS["interval_width_points"])}
        if methods:
            levels[level] = {"methods": methods, "pairs": pairs}
    sweep = []
    for method in METHODS:
        for value in SWEEPS[method]:
            runs = [r for r in runs_of(result, task, method, value) if r["seed"] in seeds_of[method]] \
                or runs_of(result, task, method, value)
            if runs:
                sweep.append({"method": method, "setting": runs[0]["setting"], "seeds": [r["seed"] for r in runs],
                              "final_pass_at_1": statistics.mean(r["validations"][-1]["pass_at_1"] for r in runs),
                              "final_kl_from_init": statistics.median(r["validations"][-1]["kl_from_init"] for r in runs),
                              **step_kl_figures(runs),
                              "median_run_s": statistics.median(r["seconds"] for r in runs)})
    timing = timing_of(result, task)
    seconds = sum(r["seconds"] for r in result["runs"] if r["task"] == task) + sum(u["seconds"] for u in untrained.values())
    # The seeds with every method's runs (all 5 once the protocol is in).
    complete = sorted(set.intersection(*(set(seeds) for seeds in seeds_of.values())))
    return {"seeds": complete, "method_seeds": seeds_of, "crossed": crossed(complete), "levels": levels,
            "sweep": sweep, "timing": timing,
            "chosen": {m: chosen_value(result, task, m, seeds_of[m]) if seeds_of[m] else None for m in METHODS},
            "machine_seconds": seconds}


# Outputs ------------------------------------------------------------------------------------
def points(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}"


def render(result: dict) -> str:
    lines = []
    if result.get("smoke"):
        lines += ["**Smoke run (2-step runs, 4 validation prompts): no figure here is a measurement.**", ""]
    total = 0.0
    for task in TASKS:
        if not untrained_of(result, task):
            continue
        summary = summarise(result, task)
        total += summary["machine_seconds"]
        untrained = ", ".join(f"seed {s} {u['pass_at_1']:.3f}" for s, u in sorted(untrained_of(result, task).items()))
        lines += [f"### {task}: {TASKS[task]['source']}", "", f"Untrained pass@1: {untrained}.", "",
                  f"Seeds with every sweep run of every method: {', '.join(map(str, summary['seeds'])) or 'none yet'}"
                  + (" (they share their validation prompts: crossed bootstrap)." if summary["crossed"] else ".")
                  + " Each method's frontier is on the seeds with all its runs ("
                  + "; ".join(f"{LABELS[m]}: {', '.join(map(str, seeds)) or 'none'}"
                              for m, seeds in summary["method_seeds"].items())
                  + "), each pair on the seeds both have.", "",
                  "| method | setting | seeds | final pass@1 (mean) | KL from init, final (median) | step KL (median over steps that moved) | steps that did not move | run s (median) |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {LABELS[s['method']]} | {s['setting']} | {', '.join(map(str, s['seeds']))} | "
                  f"{s['final_pass_at_1']:.3f} | {s['final_kl_from_init']:.2e} | {s['median_step_kl']:.2e} | "
                  f"{s['steps_still']} of {s['steps']} | {s['median_run_s']:.0f} |" for s in summary["sweep"]]
        if summary["levels"]:
            lines += ["", "Gain over the untrained model on each method's frontier (points of pass@1, [95% bootstrap]), "
                          "and the step size it takes there:", "",
                      "| KL from init | " + " | ".join(LABELS[m] for m in METHODS) + " |",
                      "|---:|" + "---|" * len(METHODS)]
            for level, entry in summary["levels"].items():
                cells = []
                for method in METHODS:
                    m = entry["methods"].get(method)
                    cells.append("not reached" if m is None else
                                 f"{m['gain_points']:+.1f} [{m['gain_interval_points'][0]:+.1f}, "
                                 f"{m['gain_interval_points'][1]:+.1f}] at {m['value']:.3g}")
                lines.append(f"| {level:g} | " + " | ".join(cells) + " |")
            lines += ["", "Paired differences at equal KL from init (points; t over seeds, bootstrap over seeds and "
                          "prompts); target: gain ratio >= 0.95, or the interval contains 0 and is at most 8 points wide:", "",
                      "| KL from init | pair | seeds | difference | t interval | bootstrap | gain ratio | target |",
                      "|---:|---|---|---:|---|---|---:|---|"]
            for level, entry in summary["levels"].items():
                for name, pair in entry["pairs"].items():
                    first, second = name.split("-")
                    t_low, t_high = pair["t_points"]
                    low, high = pair["bootstrap_points"]
                    ratio = "n/a" if pair["gain_ratio"] is None else f"{pair['gain_ratio']:.2f}"
                    verdict = "met" if pair["met"] else "missed"
                    if len(pair["seeds"]) < 5:
                        verdict += f" (on {len(pair['seeds'])} seeds; judged on 5)"
                    lines.append(f"| {level:g} | {LABELS[first]} - {LABELS[second]} | {len(pair['seeds'])} | "
                                 f"{pair['difference_points']:+.1f} | "
                                 f"[{points(t_low)}, {points(t_high)}] | [{low:+.1f}, {high:+.1f}] | {ratio} | {verdict} |")
        if summary["timing"]:
            lines += ["", "Seconds per step, each method alone (`--timing`): "
                      + ", ".join(f"{LABELS[m]} {s:.2f}" for m, s in summary["timing"].items()) + "."]
        lines += ["", f"Machine time of this task so far: {summary['machine_seconds'] / 3600:.2f} h.", ""]
    long_runs = [r for r in result["runs"] if r["kind"] == "long"]  # their seconds are in their task's
    if long_runs:
        timing = timing_of(result, long_runs[0]["task"])
        levels = " / ".join(f"{level:g}" for level in LONG_REWARD_LEVELS)
        lines += ["### Long runs (addition, seed 0)", "",
                  f"Time to a target reward: the first step at which the mean training reward of the last "
                  f"{LONG_REWARD_WINDOW} steps reaches {levels}, and that many steps at the method's seconds per "
                  "step timed alone (`--timing`; validations not counted).", "",
                  f"| method | setting | steps | pass@1 by validation | KL from init by validation | steps to reward {levels} "
                  f"| seconds alone to reward {levels} | run s |", "|---|---|---:|---|---|---|---|---:|"]
        for r in long_runs:
            curve = " ".join(f"{v['pass_at_1']:.3f}" for v in r["validations"])
            kl = " ".join(f"{v['kl_from_init']:.2f}" for v in r["validations"])
            reached = [steps_to_reward(r["reward_mean"], level) for level in LONG_REWARD_LEVELS]
            step_s = timing.get(r["method"])
            alone = " / ".join("-" if s is None else f"{s * step_s:.0f}" for s in reached) if step_s else "no --timing yet"
            lines.append(f"| {LABELS[r['method']]} | {r['setting']} | {r['steps']} | {curve} | {kl} | "
                         f"{' / '.join('-' if s is None else str(s) for s in reached)} | {alone} | {r['seconds']:.0f} |")
        lines.append("")
    lines += render_ablations(result)
    lines += [f"Machine time so far: {total / 3600:.2f} h (target at most {TARGETS['machine_hours']:g} h in all; runs "
              "side by side count their own wall clock each)."]
    lines += ["", "Parts: " + "; ".join(f"`{p['command']}` ({code_line(p['code'])} {machine_line(p['machine'])})"
                                        for p in result["parts"]) + "."]
    return "\n".join(lines)


def mean_curve(runs: list[dict], x) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min and max over the runs of pass@1 at each validation (runs of equal length)."""
    count = min(len(r["validations"]) for r in runs)
    xs = [statistics.mean(x(r, i) for r in runs) for i in range(count)]
    ys = [[r["validations"][i]["pass_at_1"] for r in runs] for i in range(count)]
    return xs, [statistics.mean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    tasks = [t for t in TASKS if untrained_of(result, t)]
    long_runs = [r for r in result["runs"] if r["kind"] == "long"]
    # The long runs: a row against steps, and one against seconds once every method in them is timed.
    long_axes = []
    if long_runs:
        long_timing = timing_of(result, long_runs[0]["task"])
        long_axes = [("step", None)] + ([("seconds alone (steps x seconds per step, --timing)", long_timing)]
                                        if all(r["method"] in long_timing for r in long_runs) else [])
    rows = len(tasks) + len(long_axes)
    figure, axes = plt.subplots(max(rows, 1), 3, figsize=(17, 4.2 * max(rows, 1)), squeeze=False)
    for row, task in zip(axes, tasks):
        summary = summarise(result, task)
        for method in METHODS:
            seeds = summary["method_seeds"][method] or sorted(untrained_of(result, task))
            untrained = statistics.mean(untrained_of(result, task)[s]["pass_at_1"] for s in seeds)
            colour = COLOURS[method]
            label = f"{LABELS[method]}, each step size"
            for value in SWEEPS[method]:  # every step size's path, mean over seeds
                runs = [r for r in runs_of(result, task, method, value) if r["seed"] in seeds]
                if runs:
                    xs, ys, _, _ = mean_curve(runs, lambda r, i: r["validations"][i]["kl_from_init"])
                    row[0].plot(xs, ys, color=colour, alpha=0.35, marker=".", linewidth=0.8, label=label)
                    label = None  # one legend entry per method
            frontier = [(level, entry["methods"][method]) for level, entry in summary["levels"].items()
                        if method in entry["methods"]]
            if frontier:
                row[0].errorbar([level for level, _ in frontier], [m["pass_at_1"] for _, m in frontier],
                                yerr=[[(m["gain_points"] - m["gain_interval_points"][0]) / 100 for _, m in frontier],
                                      [(m["gain_interval_points"][1] - m["gain_points"]) / 100 for _, m in frontier]],
                                color=colour, marker="o", capsize=3, label=f"{LABELS[method]} frontier")
            chosen = summary["chosen"].get(method) or SWEEPS[method][1]
            runs = [r for r in runs_of(result, task, method, chosen) if r["seed"] in seeds]
            if not runs:
                continue
            label = f"{LABELS[method]} {runs[0]['setting']} ({len(runs)} seeds)"
            xs, ys, low, high = mean_curve(runs, lambda r, i: r["validations"][i]["step"])
            row[1].plot([0, *xs], [untrained, *ys], color=colour, marker="o", label=label)
            row[1].fill_between(xs, low, high, color=colour, alpha=0.15)
            if method in summary["timing"]:
                seconds = [x * summary["timing"][method] for x in xs]
                row[2].plot([0, *seconds], [untrained, *ys], color=colour, marker="o", label=label)
                row[2].fill_between(seconds, low, high, color=colour, alpha=0.15)
        row[0].set_xscale("log")
        row[0].set(xlabel="KL(policy || initial) per completion token", ylabel=f"{task}: validation pass@1")
        row[1].set(xlabel="step", ylabel="validation pass@1 (chosen step size;\nthe sweep's 2nd until every seed is in)")
        row[2].set(xlabel="seconds of training (steps x each method's seconds per step, timed alone)",
                   ylabel="validation pass@1")
        if not summary["timing"]:
            row[2].set_title("no --timing part yet", fontsize=9)
        untrained = statistics.mean(u["pass_at_1"] for u in untrained_of(result, task).values())
        for axis in row:
            axis.axhline(untrained, color="grey", linestyle=":", linewidth=0.8)  # mean over every seed
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
    for row, (xlabel, timing) in zip(axes[len(tasks):], long_axes):
        for run in long_runs:
            scale = timing[run["method"]] if timing else 1.0
            colour, label = COLOURS[run["method"]], f"{LABELS[run['method']]} {run['setting']}"
            steps = [s * scale for s, _, _ in run["reward_mean"]]
            row[0].plot(steps, [v for _, v, _ in run["reward_mean"]], color=colour, alpha=0.25, linewidth=0.6)
            row[0].plot(steps, trailing_means(run["reward_mean"]), color=colour, linewidth=1.6, label=label)
            untrained = untrained_of(result, run["task"])[run["seed"]]["pass_at_1"]  # step 0
            row[1].plot([0.0] + [v["step"] * scale for v in run["validations"]],
                        [untrained] + [v["pass_at_1"] for v in run["validations"]], color=colour, marker="o", label=label)
            row[2].plot([v["step"] * scale for v in run["validations"]], [v["kl_from_init"] for v in run["validations"]],
                        color=colour, marker="o", label=label)
        row[0].set(xlabel=xlabel, ylabel=f"long runs: training reward\n(faint: each step; line: last {LONG_REWARD_WINDOW})")
        row[1].set(xlabel=xlabel, ylabel="validation pass@1")
        row[2].set(xlabel=xlabel, ylabel="KL from init", yscale="log")
        row[0].legend(fontsize=7)
    save_figure(figure, path, "GRPO, SmolLM2-135M-Instruct, reward-vs-KL frontier: faint lines = each step size "
                              "(mean over seeds), dots = the frontier at fixed KL [95% bootstrap], bands = seeds' range - "
                              f"{cpu_caption(result['parts'][-1]['machine']) if result['parts'] else ''}")
