"""RL quality: dense AdamW vs LoRA r=256 vs LoGRA r=256 on the same task, seeds and steps.

The task is the quickstart's: SmolLM2-135M-Instruct on one-digit arithmetic
(``arithmetic:1``, instruction " Answer with just the number."), GRPO, 4 prompts x 8
samples per step. The three methods run from ``configs/quickstart.yaml`` (LoGRA),
``quickstart_dense.yaml`` and ``quickstart_lora.yaml`` through the ``logra`` CLI; only the
step count, the validation schedule and set, and the swept value are overridden, so every
run samples the same prompts with the same seeds. Each method gets a two-point sweep
(dense and LoRA: learning rate; LoGRA: per-step KL budget, cosine-decayed to a quarter of
itself); the best run of each sweep, by final validation pass@1, is reported. Selecting
on the validation set flatters every method alike.

Validation pass@1: the mean correctness of 4 samples (temperature 0.7, top-p 0.7) on each
of ``VAL_SIZE`` held-out prompts, with the same sampling seeds at every evaluation. Step 0
is one ``logra validate`` of the untrained model.

    python benchmarks/quality.py     # about an hour on 2 CPU cores; writes results/quality.{json,md,png}

Run logs and the MLflow store of every run stay in ``lightning_logs/quality``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import metric_history, run_logra  # noqa: E402
from common import ROOT, argument_parser, cpu_caption, machine_info, machine_line, save_figure, save_json, write_outputs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 12
VAL_EVERY = 12
VAL_SIZE = 48
CONFIGS = {"dense": "configs/quickstart_dense.yaml", "lora": "configs/quickstart_lora.yaml", "logra": "configs/quickstart.yaml"}
SWEEPS = {
    "dense": {"lr=1e-5": ["--model.init_args.optimizer.lr=1e-5"], "lr=3e-5": ["--model.init_args.optimizer.lr=3e-5"]},
    "lora": {"lr=1e-4": ["--model.init_args.optimizer.lr=1e-4"], "lr=3e-4": ["--model.init_args.optimizer.lr=3e-4"]},
    "logra": {
        "budget=2e-3": ["--trainer.strategy.init_args.logra.kl_budget=2e-3", "--trainer.strategy.init_args.logra.kl_budget_final=5e-4"],
        "budget=5e-3": ["--trainer.strategy.init_args.logra.kl_budget=5e-3", "--trainer.strategy.init_args.logra.kl_budget_final=1.25e-3"],
    },
}
# Run only with --add, after the main sweep: LoRA's two points both lowered pass@1, so
# lower learning rates were added rather than judging LoRA on a sweep that missed its range.
EXTRA_SWEEPS = {"lora": {"lr=1e-5": ["--model.init_args.optimizer.lr=1e-5"], "lr=3e-5": ["--model.init_args.optimizer.lr=3e-5"]}}
TARGETS = {"dense_gain_points": 15.0, "logra_vs_dense": 0.95}


def train(method: str, label: str, overrides: list[str], steps: int, val_every: int, step0: float,
          common: list[str], environment: dict, work: Path) -> dict:
    name = f"{method}-{label}"
    arguments = ["fit", "-c", CONFIGS[method], *common, f"--trainer.max_steps={steps}",
                 f"--trainer.val_check_interval={val_every}", f"--trainer.logger.init_args.run_name={name}", *overrides]
    if method == "logra":
        arguments.append(f"--trainer.strategy.init_args.logra.schedule_steps={steps}")
    print(f"{name}: {steps} steps", flush=True)
    seconds = run_logra(arguments, environment, work / f"{name}.log")
    validation = [(0, step0)] + metric_history(work / "mlflow.db", name, "val/pass_at_1")
    print(f"  final pass@1 {validation[-1][1]:.3f} (gain {100 * (validation[-1][1] - step0):+.1f} points), {seconds:.0f} s", flush=True)
    return {"method": method, "setting": label, "seconds": seconds, "overrides": overrides, "val_pass_at_1": validation,
            "reward_mean": metric_history(work / "mlflow.db", name, "reward/mean")}


def common_arguments(val_size: int, work: Path) -> list[str]:
    return [f"--data.init_args.val_size={val_size}", "--trainer.logger.init_args.experiment_name=quality",
            f"--trainer.default_root_dir={work}"]


def add_runs(result: dict, names: list[str], work: Path) -> None:
    """Run extra sweep points into an existing result, with its settings and step-0 value."""
    environment = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    for name in names:
        method, _, label = name.partition("-")
        if label not in EXTRA_SWEEPS.get(method, {}):
            raise SystemExit(f"unknown extra run {name!r}; choose from "
                             f"{[f'{m}-{k}' for m, sweep in EXTRA_SWEEPS.items() for k in sweep]}")
        run = train(method, label, EXTRA_SWEEPS[method][label], result["steps"], result["val_every"], result["step0_pass_at_1"],
                    common_arguments(result["val_size"], work), environment, work)
        run["added"] = " ".join(["python", "benchmarks/quality.py", *sys.argv[1:]])
        result["runs"].append(run)


def measure(steps: int, val_every: int, val_size: int, work: Path) -> dict:
    database = work / "mlflow.db"
    environment = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{database}")
    common = common_arguments(val_size, work)
    started = time.perf_counter()
    print(f"step 0: validating the untrained model on {val_size} prompts", flush=True)
    seconds = run_logra(["validate", "-c", CONFIGS["dense"], *common, "--trainer.logger.init_args.run_name=step0"],
                  environment, work / "step0.log")
    step0 = metric_history(database, "step0", "val/pass_at_1")[-1][1]
    print(f"  pass@1 {step0:.3f} ({seconds:.0f} s)", flush=True)
    runs = [train(method, label, overrides, steps, val_every, step0, common, environment, work)
            for method, sweep in SWEEPS.items() for label, overrides in sweep.items()]
    return {"step0_pass_at_1": step0, "step0_seconds": seconds, "runs": runs, "total_seconds": time.perf_counter() - started}


def summarise(result: dict) -> dict:
    best = {}
    for method in SWEEPS:
        candidates = [r for r in result["runs"] if r["method"] == method]
        winner = max(candidates, key=lambda r: r["val_pass_at_1"][-1][1])
        best[method] = {"setting": winner["setting"], "final_pass_at_1": winner["val_pass_at_1"][-1][1],
                        "gain_points": 100 * (winner["val_pass_at_1"][-1][1] - result["step0_pass_at_1"])}
    dense, lora, logra = (best[m]["gain_points"] for m in ("dense", "lora", "logra"))
    return {
        "best": best,
        "dense_gain_met": dense >= TARGETS["dense_gain_points"],
        "logra_over_dense": logra / dense if dense else None,
        "logra_vs_dense_met": dense > 0 and logra >= TARGETS["logra_vs_dense"] * dense,
        "logra_vs_lora_met": logra >= lora,
        "within_60_minutes": result["total_seconds"] <= 3600,  # the main sweep; --add runs are extra
    }


def render(result: dict) -> str:
    summary = result["summary"]
    lines = [
        f"Start (step 0) validation pass@1: {result['step0_pass_at_1']:.3f} on {result['val_size']} prompts x 4 samples.",
        "",
        "| method | setting | final pass@1 | gain (points) | best of sweep | seconds |",
        "|---|---|---:|---:|:---:|---:|",
    ]
    for r in result["runs"]:
        final = r["val_pass_at_1"][-1][1]
        chosen = "yes" if summary["best"][r["method"]]["setting"] == r["setting"] else ""
        setting = r["setting"] + (" (added with --add)" if "added" in r else "")
        lines.append(f"| {r['method']} | {setting} | {final:.3f} | {100 * (final - result['step0_pass_at_1']):+.1f} | {chosen} | {r['seconds']:.0f} |")
    ratio = summary["logra_over_dense"]
    lines += [
        "",
        f"Dense AdamW gain {summary['best']['dense']['gain_points']:+.1f} points (target >= {TARGETS['dense_gain_points']:.0f}: "
        f"{'met' if summary['dense_gain_met'] else 'missed'}). LoGRA gain / dense gain = "
        f"{'n/a' if ratio is None else f'{ratio:.2f}'} (target >= {TARGETS['logra_vs_dense']}: {'met' if summary['logra_vs_dense_met'] else 'missed'}); "
        f"LoGRA >= LoRA: {'met' if summary['logra_vs_lora_met'] else 'missed'}. "
        f"The main sweep took {result['total_seconds'] / 60:.1f} min (target <= 60: {'met' if summary['within_60_minutes'] else 'missed'})"
        + (f"; the runs added with --add took {sum(r['seconds'] for r in result['runs'] if 'added' in r) / 60:.1f} min more."
           if any("added" in r for r in result["runs"]) else "."),
        "",
        f"{machine_line(result['machine'])}; {result['steps']} steps, validation every {result['val_every']}; command: `{result['command']}`.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"dense": "tab:blue", "lora": "tab:orange", "logra": "tab:green"}
    figure, (reward, validation) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in result["runs"]:
        best = result["summary"]["best"][r["method"]]["setting"] == r["setting"]
        style = dict(color=colours[r["method"]], alpha=1.0 if best else 0.35, linestyle="-" if best else "--",
                     label=f"{r['method']} {r['setting']}")
        steps, values = zip(*r["reward_mean"])
        reward.plot([s + 1 for s in steps], values, **style)
        # Entry 0 is the untrained model; the others carry MLflow's step, the 0-based index
        # of the last update before the validation, so they sit at updates = step + 1.
        steps, values = zip(*r["val_pass_at_1"])
        validation.plot([0] + [s + 1 for s in steps[1:]], values, marker="o", **style)
    reward.set(xlabel="step (rollout batch)", ylabel="training reward (mean of 32 samples, T=1)")
    validation.set(xlabel="updates applied", ylabel=f"validation pass@1 ({result['val_size']} prompts x 4, T=0.7)")
    save_figure(figure, path, f"GRPO, SmolLM2-135M-Instruct, arithmetic:1 - {cpu_caption(result['machine'])}, "
                              "python benchmarks/quality.py (solid: best of sweep)", legend_fontsize=7)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--val-every", type=int, default=VAL_EVERY)
    parser.add_argument("--val-size", type=int, default=VAL_SIZE)
    parser.add_argument("--out", default="quality", help="results file stem under benchmarks/results")
    parser.add_argument("--add", nargs="+", metavar="RUN",
                        help="run extra sweep points (e.g. lora-lr=1e-5) into results/<out>.json, reusing its settings, step 0 "
                             "and MLflow store")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        stem = args.render.with_suffix("")
    elif args.add:
        stem = RESULTS / args.out
        result = json.loads(stem.with_suffix(".json").read_text())
        add_runs(result, args.add, ROOT / "lightning_logs" / "quality")
        result["summary"] = summarise(result)
        save_json(stem.with_suffix(".json"), result)
    else:
        work = ROOT / "lightning_logs" / "quality"  # run logs and the MLflow store, kept for inspection
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        result = measure(args.steps, args.val_every, args.val_size, work)
        result.update({
            "command": " ".join(["python", "benchmarks/quality.py", *sys.argv[1:]]),
            "machine": machine_info(),
            "steps": args.steps, "val_every": args.val_every, "val_size": args.val_size,
        })
        result["summary"] = summarise(result)
        stem = RESULTS / args.out
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
