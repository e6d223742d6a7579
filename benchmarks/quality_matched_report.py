"""What ``quality_matched`` reports: per task, the gains with intervals, the paired
differences, steps and seconds to the threshold (``summarise``), as Markdown (``render``)
and curves with seed bands (``plot``). The protocol and its settings are ``quality_matched_protocol``'s."""

from __future__ import annotations

import statistics
from pathlib import Path

from .harness import cpu_caption, machine_line, pyplot, save_figure
from .paired_stats import bootstrap_interval, first_reaching, median_or_none, seed_mean
from .quality_matched_protocol import (ABLATION_PAIRS, ABLATIONS, METHODS, PAIRS, SEEDS, SELECTION_SEED, TARGETS,
                                       TASKS, VAL_SAMPLES, VAL_SIZE, per_prompt_final, reported)


def summarise(result: dict, task: str) -> dict:
    untrained = {u["seed"]: u for u in result["untrained"] if u["task"] == task}
    threshold = TASKS[task]["threshold_points"]
    methods = {}
    for method in (*METHODS, *ABLATIONS):
        runs = reported(result, task, method)
        if not runs:
            continue
        gains = [[f - c / VAL_SAMPLES for f, c in zip(per_prompt_final(r), untrained[r["seed"]]["correct"])] for r in runs]
        reached = [first_reaching(r["val_pass_at_1"], untrained[r["seed"]]["pass_at_1"] + threshold / 100) for r in runs]
        methods[method] = {
            "setting": runs[0]["setting"], "seeds": [r["seed"] for r in runs],
            "gains_points": [100 * statistics.mean(g) for g in gains], "gain_points": 100 * seed_mean(gains),
            "gain_interval_points": [100 * x for x in bootstrap_interval(gains)],
            "median_step_kl": statistics.median(v for r in runs for _, v, _ in r["step_kl"]),
            "steps_to_threshold": [s for s, _ in reached], "seconds_to_threshold": [t for _, t in reached],
            "median_steps_to_threshold": median_or_none([s for s, _ in reached]),
            "median_seconds_to_threshold": median_or_none([t for _, t in reached]),
            "median_run_s": statistics.median(r["seconds"] for r in runs),
        }
    pairs = {}
    for first, second in (*PAIRS, *ABLATION_PAIRS):
        runs = {m: {r["seed"]: r for r in reported(result, task, m)} for m in (first, second)}
        seeds = sorted(set(runs[first]) & set(runs[second]))
        if not seeds:
            continue
        differences = [[a - b for a, b in zip(per_prompt_final(runs[first][s]), per_prompt_final(runs[second][s]))]
                       for s in seeds]
        low, high = (100 * x for x in bootstrap_interval(differences))
        # The ratio on the pair's own seeds: a row with fewer seeds is compared with the same seeds of dense.
        dense_gain, gain_ = (statistics.fmean(dict(zip(methods[m]["seeds"], methods[m]["gains_points"]))[s] for s in seeds)
                             for m in (second, first))
        pairs[f"{first}-{second}"] = {
            "seeds": seeds, "difference_points": 100 * seed_mean(differences), "interval_points": [low, high],
            "width_points": high - low, "width_met": high - low <= TARGETS["interval_width_points"],
            "gain_ratio": gain_ / dense_gain if dense_gain > 0 else None,
            "not_worse": low <= 0 <= high or (dense_gain > 0 and gain_ >= TARGETS["matched_gain_over_dense"] * dense_gain)}
    selection = [{"method": r["method"], "setting": r["setting"], "final_pass_at_1": r["val_pass_at_1"][-1][1],
                  "median_step_kl": statistics.median(v for _, v, _ in r["step_kl"]), "seconds": r["seconds"]}
                 for r in result["runs"] if r["task"] == task and r["seed"] == SELECTION_SEED]
    return {"methods": methods, "pairs": pairs, "selection": selection, "threshold_points": threshold,
            "machine_seconds": sum(r["seconds"] for r in result["runs"] if r["task"] == task)
            + sum(u["seconds"] for u in untrained.values())}


# Outputs ------------------------------------------------------------------------------------
def fmt(value, pattern: str, missing: str = "not reached") -> str:
    return missing if value is None else format(value, pattern)


def render(result: dict) -> str:
    lines = []
    if result.get("smoke"):
        lines += ["**Smoke run (2-step runs, 4 validation prompts): no figure here is a measurement.**", ""]
    if result.get("screening"):
        lines += ["Screening of reasoning-gym tasks, the untrained model's pass@1 (full credit; "
                  f"{VAL_SIZE} prompts x {VAL_SAMPLES} samples, seed {SELECTION_SEED}): "
                  + ", ".join(f"{s['task']}" + (f" with {s['instruction']!r}" if s.get("instruction") else "")
                              + f" {s['pass_at_1']:.3f}" for s in result["screening"]) + ".", ""]
    total = 0.0
    for task in TASKS:
        if not any(u["task"] == task for u in result["untrained"]):
            continue
        summary = summarise(result, task)
        total += summary["machine_seconds"]
        untrained = ", ".join(f"seed {u['seed']} {u['pass_at_1']:.3f}" for u in result["untrained"] if u["task"] == task)
        lines += [f"### {task}: {TASKS[task]['source']}", "", f"Untrained pass@1: {untrained}.", "",
                  f"Selection (seed {SELECTION_SEED}, not reported):", "",
                  "| method | setting | final pass@1 | median step KL | run s |", "|---|---|---:|---:|---:|"]
        lines += [f"| {s['method']} | {s['setting']} | {s['final_pass_at_1']:.3f} | {s['median_step_kl']:.2e} | {s['seconds']:.0f} |"
                  for s in summary["selection"]]
        if summary["methods"]:
            lines += ["", "| method | setting | seeds | gain (points) [95% interval] | per seed | median step KL | "
                          f"steps to +{summary['threshold_points']:g} (median) | seconds to +{summary['threshold_points']:g} (median) | run s |",
                      "|---|---|---|---:|---|---:|---|---|---:|"]
        else:
            lines += ["", "No reported run yet."]
        for method, m in summary["methods"].items():
            low, high = m["gain_interval_points"]
            steps = ", ".join(fmt(s, "d", "-") for s in m["steps_to_threshold"])
            seconds = ", ".join(fmt(t, ".0f", "-") for t in m["seconds_to_threshold"])
            lines.append(f"| {method} | {m['setting']} | {', '.join(map(str, m['seeds']))} | {m['gain_points']:+.1f} "
                         f"[{low:+.1f}, {high:+.1f}] | {', '.join(f'{g:+.1f}' for g in m['gains_points'])} | "
                         f"{m['median_step_kl']:.2e} | {steps} ({fmt(m['median_steps_to_threshold'], '.0f')}) | "
                         f"{seconds} ({fmt(m['median_seconds_to_threshold'], '.0f')}) | {m['median_run_s']:.0f} |")
        lines.append("")
        for name, pair in summary["pairs"].items():
            low, high = pair["interval_points"]
            ratio = fmt(pair["gain_ratio"], ".2f", "n/a")
            if tuple(name.split("-")) in ABLATION_PAIRS:  # a diagnosis, not a target
                lines.append(f"Ablation {name.replace('-', ' - ')} (seeds {', '.join(map(str, pair['seeds']))}): "
                             f"{pair['difference_points']:+.1f} points [{low:+.1f}, {high:+.1f}]; gain ratio {ratio}.")
                continue
            head = (f"Paired difference {name.replace('-', ' - ')} (seeds {', '.join(map(str, pair['seeds']))}): "
                    f"{pair['difference_points']:+.1f} points [{low:+.1f}, {high:+.1f}], width {pair['width_points']:.1f}")
            if pair["seeds"] != list(SEEDS):  # the targets are judged on every reported seed, not on a part of them
                lines.append(f"{head}; gain ratio {ratio}; targets pending until seeds {', '.join(map(str, SEEDS))} are in.")
                continue
            lines.append(f"{head} (target <= {TARGETS['interval_width_points']:g}: {'met' if pair['width_met'] else 'missed'}); "
                         f"gain ratio {ratio}; LoGRA >= {TARGETS['matched_gain_over_dense']} x dense or the interval "
                         f"contains 0: {'met' if pair['not_worse'] else 'missed'}.")
        lines += [f"Machine time of this task so far: {summary['machine_seconds'] / 3600:.2f} h.", ""]
    missing = [(task, method, seed) for task in TASKS for method in METHODS for seed in SEEDS
               if seed not in {r["seed"] for r in reported(result, task, method)}]
    verdict = ("met" if total <= TARGETS["total_hours"] * 3600 else "missed") if not missing else (
        f"{'missed already' if total > TARGETS['total_hours'] * 3600 else 'not decided'}: "
        f"{len(missing)} reported runs are still to run")
    lines += [f"Whole protocol so far: {total / 3600:.2f} h of machine time (target <= {TARGETS['total_hours']:g} h: {verdict})."]
    lines += [f"Note: {note}." for note in result["notes"]]
    lines += ["", "Parts: " + "; ".join(f"`{p['command']}` ({machine_line(p['machine'])})" for p in result["parts"]) + "."]
    return "\n".join(lines)


def band(axis, curves: list[list[tuple[float, float]]], colour: str, label: str) -> None:
    """The mean over seeds of curves sampled at the same points, with the seeds' range."""
    points = min(len(c) for c in curves)
    xs = [statistics.mean(c[i][0] for c in curves) for i in range(points)]
    ys = [[c[i][1] for c in curves] for i in range(points)]
    axis.plot(xs, [statistics.mean(y) for y in ys], color=colour, label=label)
    axis.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=colour, alpha=0.15)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    colours = {"dense": "tab:blue", "dense_paper": "tab:purple", "lora": "tab:orange", "logra": "tab:green",
               "logra_matched": "tab:red", "dense_no_momentum": "tab:cyan", "logra_probe8": "tab:olive"}
    tasks = [t for t in TASKS if any(u["task"] == t for u in result["untrained"])]
    figure, axes = plt.subplots(max(len(tasks), 1), 3, figsize=(16, 4 * max(len(tasks), 1)), squeeze=False)
    for row, task in zip(axes, tasks):
        untrained = {u["seed"]: u["pass_at_1"] for u in result["untrained"] if u["task"] == task}
        for method in (*METHODS, *ABLATIONS):
            runs = reported(result, task, method)
            if not runs:
                continue
            label = f"{method} {runs[0]['setting']} ({len(runs)} seeds)"
            band(row[0], [[(s, v) for s, v, _ in r["reward_mean"]] for r in runs], colours[method], label)
            band(row[1], [[(t, v) for _, v, t in r["reward_mean"]] for r in runs], colours[method], label)
            band(row[2], [[(s, v - untrained[r["seed"]]) for s, v, _ in r["val_pass_at_1"]] for r in runs],
                 colours[method], label)
        row[2].axhline(TASKS[task]["threshold_points"] / 100, color="grey", linestyle=":", label="threshold")
        row[0].set(xlabel="step", ylabel=f"{task}: training reward (32 samples)")
        row[1].set(xlabel="wall-clock seconds since the run started", ylabel="training reward")
        row[2].set(xlabel="step", ylabel=f"validation pass@1 gain ({VAL_SIZE} prompts x {VAL_SAMPLES})")
        row[2].legend(fontsize=7)
    save_figure(figure, path, f"GRPO, SmolLM2-135M-Instruct: mean over seeds, band = their range - "
                              f"{cpu_caption(result['parts'][-1]['machine']) if result['parts'] else ''}")
