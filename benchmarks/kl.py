"""KL controller: predicted vs measured KL of every applied update, and measured vs budget.

A short LoGRA RL run (the quickstart task: SmolLM2-135M-Instruct, one-digit arithmetic,
``configs/quickstart.yaml``) with ``LoGRACallback(measure_kl=True)``. At every step the
callback logs the probe's prediction for the update it is about to apply, scaled by
alpha^2 (``logra/predicted_kl_scaled``), the budget (``logra/budget``, after the mismatch
subtraction) and alpha; after the update it logs the exact full-vocabulary KL between the
policy before and after on the same probe responses (``logra/measured_kl``).

Targets: median |measured / predicted - 1| <= 3%; measured <= 1.5 x budget on >= 95% of
steps; measured >= 0.5 x budget on >= 90% of the steps whose alpha was below alpha_max.

    python -m benchmarks.kl            # 24 steps, about 15 minutes on 2 CPU cores
    python -m benchmarks.kl --render benchmarks/results/kl.json
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .cli_runs import fresh_work, metric_history, mlflow_environment, run_logra
from .harness import (argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)

STEPS = 24
ALPHA_MAX = 3.0  # LoGRAConfig's default, which the quickstart config keeps
OVERLAY = """\
trainer:
  callbacks:
    - class_path: lightning_logra.LoGRACallback
      init_args:
        measure_kl: true
    - class_path: lightning_logra.callbacks.RunSummary
"""
KEYS = ("predicted_kl", "predicted_kl_scaled", "measured_kl", "budget", "alpha")


def measure(steps: int, work: Path) -> dict:
    database = work / "mlflow.db"
    overlay = work / "measure_kl.yaml"
    overlay.write_text(OVERLAY)
    environment = mlflow_environment(work)
    arguments = ["fit", "-c", "configs/quickstart.yaml", "-c", str(overlay), f"--trainer.max_steps={steps}",
                 f"--trainer.strategy.init_args.logra.schedule_steps={steps}", f"--trainer.default_root_dir={work}",
                 "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
                 "--trainer.logger.init_args.experiment_name=kl", "--trainer.logger.init_args.run_name=kl"]
    print(f"LoGRA run with measured KL: {steps} steps", flush=True)
    seconds = run_logra(arguments, environment, work / "kl.log")
    series = {key: dict(metric_history(database, "kl", f"logra/{key}")) for key in KEYS}
    steps_seen = sorted(set.intersection(*(set(values) for values in series.values())))
    rows = [{"step": step, **{key: series[key][step] for key in KEYS}} for step in steps_seen]
    return {"seconds": seconds, "steps": rows}


def summarise(rows: list[dict]) -> dict:
    errors = [abs(r["measured_kl"] / r["predicted_kl_scaled"] - 1) for r in rows if r["predicted_kl_scaled"] > 0]
    over = [r["measured_kl"] <= 1.5 * r["budget"] for r in rows]
    uncapped = [r for r in rows if r["alpha"] < ALPHA_MAX]
    under = [r["measured_kl"] >= 0.5 * r["budget"] for r in uncapped]
    summary = {
        "updates": len(rows),
        "median_relative_error": statistics.median(errors),
        "max_relative_error": max(errors),
        "share_within_1_5x_budget": sum(over) / len(over),
        "uncapped_updates": len(uncapped),
        "share_uncapped_above_0_5x_budget": sum(under) / len(under) if under else None,
    }
    summary["median_error_met"] = summary["median_relative_error"] <= 0.03
    summary["upper_met"] = summary["share_within_1_5x_budget"] >= 0.95
    summary["lower_met"] = summary["share_uncapped_above_0_5x_budget"] is not None and summary["share_uncapped_above_0_5x_budget"] >= 0.90
    return summary


def render(result: dict) -> str:
    s = result["summary"]
    lower = s["share_uncapped_above_0_5x_budget"]
    lines = [
        "| step | alpha | predicted x alpha^2 | measured | measured / predicted | budget | measured / budget |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["steps"]:
        lines.append(f"| {r['step']} | {r['alpha']:.3f} | {r['predicted_kl_scaled']:.3e} | {r['measured_kl']:.3e} | "
                     f"{r['measured_kl'] / r['predicted_kl_scaled']:.4f} | {r['budget']:.3e} | {r['measured_kl'] / r['budget']:.3f} |")
    lines += [
        "",
        f"Median |measured / predicted - 1| = **{100 * s['median_relative_error']:.2f}%** (max {100 * s['max_relative_error']:.2f}%; "
        f"target <= 3%: {'met' if s['median_error_met'] else 'missed'}). "
        f"Measured <= 1.5 x budget on **{100 * s['share_within_1_5x_budget']:.0f}%** of {s['updates']} updates "
        f"(target >= 95%: {'met' if s['upper_met'] else 'missed'}); measured >= 0.5 x budget on "
        f"**{'n/a' if lower is None else f'{100 * lower:.0f}%'}** of the {s['uncapped_updates']} updates with alpha < {ALPHA_MAX:g} "
        f"(target >= 90%: {'met' if s['lower_met'] else 'missed'}).",
        "",
        f"{machine_line(result['machine'])}; {len(result['steps'])} steps in {result['seconds']:.0f} s; command: `{result['command']}`.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["steps"]
    figure, (scatter, budget) = plt.subplots(1, 2, figsize=(12, 4.2))
    predicted = [r["predicted_kl_scaled"] for r in rows]
    measured = [r["measured_kl"] for r in rows]
    capped = [r["alpha"] >= ALPHA_MAX for r in rows]
    scatter.scatter([p for p, c in zip(predicted, capped) if not c], [m for m, c in zip(measured, capped) if not c],
                    s=18, label="alpha < alpha_max")
    scatter.scatter([p for p, c in zip(predicted, capped) if c], [m for m, c in zip(measured, capped) if c],
                    s=18, marker="x", label="alpha capped at alpha_max")
    low, high = min(predicted + measured) * 0.8, max(predicted + measured) * 1.25
    scatter.plot([low, high], [low, high], color="grey", linewidth=1, label="y = x")
    scatter.set(xscale="log", yscale="log", xlabel="predicted KL of the applied update (alpha^2 x probe)",
                ylabel="measured KL (full vocabulary, probe responses)")
    steps = [r["step"] + 1 for r in rows]
    budget.plot(steps, [r["budget"] for r in rows], color="black", label="budget (after mismatch)")
    budget.fill_between(steps, [0.5 * r["budget"] for r in rows], [1.5 * r["budget"] for r in rows], color="grey", alpha=0.2,
                        label="0.5x to 1.5x budget")
    budget.plot(steps, measured, marker="o", markersize=3, label="measured KL")
    budget.set(xlabel="update", ylabel="KL per generated token")
    save_figure(figure, path, f"LoGRA KL control, SmolLM2-135M-Instruct on arithmetic:1 - {cpu_caption(result['machine'])}, "
                              f"{result['command']}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    stem = args.out / "kl"
    if args.render:
        result = load_json(args.render)
    else:
        work = fresh_work("kl")
        result = measure(args.steps, work)
        result.update({"command": command_line("kl"), "machine": machine_info(), "code": code_version()})
        result["summary"] = summarise(result["steps"])
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
