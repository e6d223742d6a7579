"""RL quality with error bars: dense AdamW vs LoRA r=256 vs LoGRA r=256 and ``rank: auto``
(r=64 on this model), and time to quality.

The task is the quickstart's: SmolLM2-135M-Instruct on one-digit arithmetic
(``arithmetic:1``, instruction " Answer with just the number."), GRPO, 4 prompts x 8
samples per step. The three methods run from ``configs/quickstart.yaml`` (LoGRA),
``quickstart_dense.yaml`` and ``quickstart_lora.yaml`` through the ``logra`` CLI; only the
step count, the validation schedule and set, the seed and the swept value are overridden
and ``logra.rank`` (256 for ``logra``, ``auto`` for ``logra_rank_auto``: these runs decided
that the quickstart's rank is ``auto``).

Protocol, fixed before measuring:
1. Each method's sweep (``SWEEPS``, three points each: dense and LoRA the learning rate,
   LoGRA the per-step KL budget, cosine-decayed to a quarter of itself) runs with seed 0.
   The best point, by final validation pass@1, must not sit at the edge of its sweep: if
   it does, the sweep is extended one point at a time in that direction (the sweep's own
   ratio, at most ``MAX_EXTENSIONS`` points), and the result says so.
2. Each method's best point runs again with seeds 1 and 2: the module's sampling seed,
   the data module's seed (the prompts' order and the validation set), ``seed_everything``
   and, for LoGRA, its projection seed (42 + seed) all change, so the prompts drawn, the
   validation prompts and every sample differ.
3. Reported per method: the mean +- standard deviation over the 3 seeds of the pass@1 gain
   (final minus the untrained model's, validated with the same seed), and the time to
   quality: wall-clock seconds from the start of a run until its validation pass@1 first
   reaches the untrained value + 90% of dense AdamW's mean final gain, as the median over
   the seeds (a seed that never reaches it counts as infinitely slow). Validation runs
   every ``VAL_EVERY`` steps in every run alike, so its time is in every method's clock.

Validation pass@1: the mean correctness of 4 samples (temperature 0.7, top-p 0.7) on each
of ``VAL_SIZE`` held-out prompts. To fit the whole script in 2 hours on 2 cores the
validation set is 24 prompts (96 samples; the comparison itself, 3 points x 4 methods and
3 seeds of each best point, is not reduced). Selecting on the validation set flatters
every method alike.

    python -m benchmarks.quality     # about 2 hours on 2 CPU cores; writes benchmarks/results/quality.{json,md,png}
    python -m benchmarks.quality --render benchmarks/results/quality.json

Run logs and the MLflow store of every run stay in ``lightning_logs/quality``.

This protocol cannot rank the methods (one pass@1 point on 24 prompts has a standard error
of 4-10 points; the best points were chosen on a reported seed; step sizes were not
matched); ``quality_matched.py`` is the second protocol, which can.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from .cli_runs import fresh_work, mlflow_environment, run_logra, timed_metric_history
from .harness import (argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)

STEPS = 12
VAL_EVERY = 3
VAL_SIZE = 24
SEEDS = (0, 1, 2)  # the sweep runs with the first; the best point with the others too
MAX_EXTENSIONS = 2
CONFIGS = {"dense": "configs/quickstart_dense.yaml", "lora": "configs/quickstart_lora.yaml", "logra": "configs/quickstart.yaml",
           "logra_rank_auto": "configs/quickstart.yaml"}
LOGRA_METHODS = ("logra", "logra_rank_auto")
# Swept values in increasing order; chosen before measuring (2026-12-01) around each
# method's best point of the earlier two-point sweeps (dense 1e-5, LoRA 3e-5, LoGRA 5e-3).
SWEEPS = {"dense": (3e-6, 1e-5, 3e-5), "lora": (1e-5, 3e-5, 1e-4), "logra": (2e-3, 5e-3, 1.25e-2),
          "logra_rank_auto": (2e-3, 5e-3, 1.25e-2)}
TARGETS = {"logra_gain_over_dense": 0.95, "quality_fraction": 0.90, "total_hours": 2.0}


def overrides(method: str, value: float) -> list[str]:
    if method in LOGRA_METHODS:
        rank = "auto" if method == "logra_rank_auto" else "256"
        return [f"--trainer.strategy.init_args.logra.kl_budget={value:g}",
                f"--trainer.strategy.init_args.logra.kl_budget_final={value / 4:g}",
                f"--trainer.strategy.init_args.logra.rank={rank}"]
    return [f"--model.init_args.optimizer.lr={value:g}"]


def label(method: str, value: float) -> str:
    return f"{'budget' if method in LOGRA_METHODS else 'lr'}={value:g}"


class Runs:
    """Runs ``logra`` into one MLflow store and reads each run's curves back."""

    def __init__(self, work: Path, steps: int, val_every: int, val_size: int) -> None:
        self.work, self.steps, self.val_every, self.val_size = work, steps, val_every, val_size
        self.environment = mlflow_environment(work)

    def common(self, seed: int) -> list[str]:
        # Every seed the run has: sampling (the module's), the prompts' order and the
        # validation set (the data module's), and everything else (seed_everything).
        return [f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
                f"--data.init_args.val_size={self.val_size}",
                "--trainer.logger.init_args.experiment_name=quality", f"--trainer.default_root_dir={self.work}"]

    def untrained(self, seed: int) -> dict:
        name = f"step0-seed{seed}"
        print(f"{name}: validating the untrained model on {self.val_size} prompts", flush=True)
        seconds = run_logra(["validate", "-c", CONFIGS["dense"], *self.common(seed), f"--trainer.logger.init_args.run_name={name}"],
                            self.environment, self.work / f"{name}.log")
        pass_at_1 = timed_metric_history(self.work / "mlflow.db", name, "val/pass_at_1")[-1][1]
        print(f"  pass@1 {pass_at_1:.3f} ({seconds:.0f} s)", flush=True)
        return {"seed": seed, "pass_at_1": pass_at_1, "seconds": seconds}

    def train(self, method: str, value: float, seed: int, step0: float) -> dict:
        name = f"{method}-{label(method, value)}-seed{seed}"
        arguments = ["fit", "-c", CONFIGS[method], *self.common(seed), f"--trainer.max_steps={self.steps}",
                     f"--trainer.val_check_interval={self.val_every}", f"--trainer.logger.init_args.run_name={name}",
                     *overrides(method, value)]
        if method in LOGRA_METHODS:  # its random projections are seeded too
            arguments += [f"--trainer.strategy.init_args.logra.schedule_steps={self.steps}",
                          f"--trainer.strategy.init_args.logra.seed={42 + seed}"]
        print(f"{name}: {self.steps} steps", flush=True)
        seconds = run_logra(arguments, self.environment, self.work / f"{name}.log")
        database = self.work / "mlflow.db"
        validation = timed_metric_history(database, name, "val/pass_at_1")
        final = validation[-1][1]
        print(f"  final pass@1 {final:.3f} (gain {100 * (final - step0):+.1f} points), {seconds:.0f} s", flush=True)
        return {"method": method, "value": value, "setting": label(method, value), "seed": seed, "seconds": seconds,
                "step0_pass_at_1": step0, "val_pass_at_1": validation,
                "reward_mean": timed_metric_history(database, name, "reward/mean")}


def gain(run: dict) -> float:
    return 100 * (run["val_pass_at_1"][-1][1] - run["step0_pass_at_1"])


def sweep(runs: Runs, method: str, step0: float) -> tuple[list[dict], list[str]]:
    """Seed-0 runs of the method's sweep, extended while its best sits at an edge."""
    values = list(SWEEPS[method])
    results = {value: runs.train(method, value, SEEDS[0], step0) for value in values}
    notes = []
    for _ in range(MAX_EXTENSIONS):
        ordered = sorted(results)
        best = max(ordered, key=lambda value: gain(results[value]))
        if best not in (ordered[0], ordered[-1]):
            break
        ratio = ordered[1] / ordered[0] if best == ordered[0] else ordered[-1] / ordered[-2]
        extra = best / ratio if best == ordered[0] else best * ratio
        notes.append(f"{method}: best {label(method, best)} at the edge of the sweep; extended to {label(method, extra)}")
        print(notes[-1], flush=True)
        results[extra] = runs.train(method, extra, SEEDS[0], step0)
    return [results[value] for value in sorted(results)], notes


def measure(runs: Runs) -> dict:
    started = time.perf_counter()
    untrained = {seed: runs.untrained(seed) for seed in SEEDS}
    all_runs, notes = [], []
    for method in CONFIGS:
        points, extended = sweep(runs, method, untrained[SEEDS[0]]["pass_at_1"])
        all_runs += points
        notes += extended
        best = max(points, key=gain)
        all_runs += [runs.train(method, best["value"], seed, untrained[seed]["pass_at_1"]) for seed in SEEDS[1:]]
    return {"untrained": list(untrained.values()), "runs": all_runs, "notes": notes,
            "total_seconds": time.perf_counter() - started}


def summarise(result: dict) -> dict:
    best = {}
    for method in CONFIGS:
        seeded = [r for r in result["runs"] if r["method"] == method and r["seed"] == SEEDS[0]]
        winner = max(seeded, key=gain)
        repeats = [r for r in result["runs"] if r["method"] == method and r["value"] == winner["value"]]
        gains = [gain(r) for r in repeats]
        best[method] = {"setting": winner["setting"], "seeds": [r["seed"] for r in repeats], "gains_points": gains,
                        "gain_mean": statistics.mean(gains), "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0}
    threshold = TARGETS["quality_fraction"] * best["dense"]["gain_mean"] / 100
    for method, entry in best.items():
        times = []
        for run in (r for r in result["runs"] if r["method"] == method and r["setting"] == entry["setting"]):
            reached = [seconds for _, value, seconds in run["val_pass_at_1"] if value >= run["step0_pass_at_1"] + threshold]
            times.append(reached[0] if reached else None)
        entry["time_to_quality_s"] = times
        # The median over seeds, a seed that never reached the threshold counting as
        # infinitely slow (None when most seeds never reached it).
        median = statistics.median(math.inf if t is None else t for t in times)
        entry["time_to_quality_median_s"] = None if math.isinf(median) else median
    dense = best["dense"]
    dense_time = dense["time_to_quality_median_s"]
    summary = {"best": best, "quality_threshold_points": 100 * threshold,
               "within_budget": result["total_seconds"] <= TARGETS["total_hours"] * 3600}
    for method in LOGRA_METHODS:
        logra = best[method]
        logra_time = logra["time_to_quality_median_s"]
        summary[f"{method}_gain_over_dense"] = logra["gain_mean"] / dense["gain_mean"] if dense["gain_mean"] else None
        summary[f"{method}_gain_met"] = (dense["gain_mean"] > 0
                                         and logra["gain_mean"] >= TARGETS["logra_gain_over_dense"] * dense["gain_mean"])
        summary[f"{method}_time_met"] = logra_time is not None and (dense_time is None or logra_time <= dense_time)
    return summary


def render(result: dict) -> str:
    summary = result["summary"]
    untrained = ", ".join(f"seed {u['seed']} {u['pass_at_1']:.3f}" for u in result["untrained"])
    lines = [f"Untrained validation pass@1 ({result['val_size']} prompts x 4 samples): {untrained}.", "",
             "| method | setting | seed | final pass@1 | gain (points) | run s |", "|---|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['method']} | {r['setting']} | {r['seed']} | {r['val_pass_at_1'][-1][1]:.3f} | {gain(r):+.1f} | {r['seconds']:.0f} |")
    lines += ["", "| method | best setting | gain over 3 seeds (points) | time to quality per seed (s) | median (s) |",
              "|---|---|---:|---|---:|"]
    for method, entry in summary["best"].items():
        times = ", ".join("not reached" if t is None else f"{t:.0f}" for t in entry["time_to_quality_s"])
        median = "not reached" if entry["time_to_quality_median_s"] is None else f"{entry['time_to_quality_median_s']:.0f}"
        lines.append(f"| {method} | {entry['setting']} | {entry['gain_mean']:+.1f} +- {entry['gain_std']:.1f} | {times} | {median} |")
    lines += ["", f"Quality threshold: the untrained pass@1 + {summary['quality_threshold_points']:.1f} points "
                  f"({100 * TARGETS['quality_fraction']:.0f}% of dense AdamW's mean gain)."]
    for method in LOGRA_METHODS:
        ratio = summary[f"{method}_gain_over_dense"]
        lines.append(
            f"{method}: mean gain / dense mean gain = {'n/a' if ratio is None else f'{ratio:.2f}'} (target >= "
            f"{TARGETS['logra_gain_over_dense']}: {'met' if summary[f'{method}_gain_met'] else 'missed'}); time to quality <= "
            f"dense AdamW's: {'met' if summary[f'{method}_time_met'] else 'missed'}.")
    lines += [
        f"The whole script took {result['total_seconds'] / 3600:.2f} h (target <= {TARGETS['total_hours']:g}: "
        f"{'met' if summary['within_budget'] else 'missed'}).",
        *([""] + [f"Sweep extended: {note}." for note in result["notes"]] if result["notes"] else []),
        "",
        f"{machine_line(result['machine'])}; {result['steps']} steps, validation every {result['val_every']}; "
        f"command: `{result['command']}`.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    colours = {"dense": "tab:blue", "lora": "tab:orange", "logra": "tab:green", "logra_rank_auto": "tab:red"}
    figure, (reward, validation) = plt.subplots(1, 2, figsize=(12, 4.2))
    for method, entry in result["summary"]["best"].items():
        repeats = [r for r in result["runs"] if r["method"] == method and r["setting"] == entry["setting"]]
        for axis, key, gains_from in ((reward, "reward_mean", None), (validation, "val_pass_at_1", "step0_pass_at_1")):
            curves = [[(seconds, value - (r[gains_from] if gains_from else 0.0)) for _, value, seconds in r[key]] for r in repeats]
            points = min(len(curve) for curve in curves)
            seconds = [statistics.mean(curve[i][0] for curve in curves) for i in range(points)]
            values = [[curve[i][1] for curve in curves] for i in range(points)]
            mean = [statistics.mean(v) for v in values]
            spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            axis.plot(seconds, mean, color=colours[method], marker="o" if gains_from else None,
                      label=f"{method} {entry['setting']} ({len(repeats)} seeds)")
            axis.fill_between(seconds, [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)],
                              color=colours[method], alpha=0.2)
    validation.axhline(result["summary"]["quality_threshold_points"] / 100, color="grey", linestyle=":", label="quality threshold")
    reward.set(xlabel="wall-clock seconds since the run started", ylabel="training reward (mean of 32 samples, T=1)")
    validation.set(xlabel="wall-clock seconds since the run started",
                   ylabel=f"validation pass@1 gain ({result['val_size']} prompts x 4, T=0.7)")
    save_figure(figure, path, f"GRPO, SmolLM2-135M-Instruct, arithmetic:1, mean +- std over seeds - "
                              f"{cpu_caption(result['machine'])}, {result['command']}", legend_fontsize=7)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--val-every", type=int, default=VAL_EVERY)
    parser.add_argument("--val-size", type=int, default=VAL_SIZE)
    parser.add_argument("--name", default="quality", help="results file stem in --out (default quality)")
    args = parser.parse_args()
    stem = args.out / args.name
    if args.render:
        result = load_json(args.render)
    else:
        work = fresh_work("quality")
        result = measure(Runs(work, args.steps, args.val_every, args.val_size))
        result.update({"command": command_line("quality"), "machine": machine_info(), "code": code_version(),
                       "steps": args.steps, "val_every": args.val_every, "val_size": args.val_size})
        result["summary"] = summarise(result)
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
