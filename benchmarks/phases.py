"""Where one RL step's wall time goes: dense AdamW vs LoRA r=256 vs LoGRA r=256 on the
quickstart task, phase by phase, from the ``perf/*`` metrics every run logs; and LoGRA with
``rank: auto`` (64 on SmolLM2-135M), the rank rule for small models and the quickstart's rank.

The three quickstart configs (LoGRA at ``rank: 256``, and again at the quickstart's own
``rank: auto``) run through the ``logra`` CLI one after the other (same seeds, same prompts, the configs' 12 steps),
without validation so that only training steps are timed. Phases, as ``GRPOModule`` logs them: ``generation`` (HF ``generate``),
``rewards`` (scoring and advantages), ``forward_backward`` (every micro-batch),
``optimizer_step`` (AdamW, or the whole LoGRA update, itself split into
``logra_prepare`` / ``logra_probe`` / ``logra_apply``), ``weight_sync`` (the rollout
engine's). The per-step median of each phase is reported; the first step (warm-up) is
left out. Run it alone on the machine: it measures wall time.

    python -m benchmarks.phases      # about 25 minutes on 2 CPU cores; benchmarks/results/phases.{json,md,png}
    python -m benchmarks.phases --render benchmarks/results/phases.json
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .cli_runs import metric_history, mlflow_environment, run_logra
from .harness import (argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, stacked_bars, write_outputs)

# name -> (config, extra arguments)
RUNS = {
    "dense": ("configs/quickstart_dense.yaml", []),
    "lora": ("configs/quickstart_lora.yaml", []),
    "logra": ("configs/quickstart.yaml", ["--trainer.strategy.init_args.logra.rank=256"]),
    "logra_rank_auto": ("configs/quickstart.yaml", ["--trainer.strategy.init_args.logra.rank=auto"]),
}
PHASES = ("generation", "rewards", "forward_backward", "optimizer_step", "weight_sync")
LOGRA_PHASES = ("logra_prepare", "logra_probe", "logra_apply")


def measure(work: Path) -> dict:
    database = work / "mlflow.db"
    environment = mlflow_environment(work)
    modes = {}
    for mode, (config, extra) in RUNS.items():
        print(f"{mode}: logra fit -c {config} {' '.join(extra)}", flush=True)
        seconds = run_logra(["fit", "-c", config, "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={work}",
                             "--trainer.logger.init_args.experiment_name=phases", f"--trainer.logger.init_args.run_name={mode}",
                             *extra], environment, work / f"{mode}.log")
        modes[mode] = read_mode(database, mode, seconds)
        print(f"  {seconds:.0f} s; median step phases: "
              + ", ".join(f"{p} {modes[mode]['median_s'][p]:.2f}" for p in PHASES), flush=True)
    return {"modes": modes}


def read_mode(database: Path, mode: str, wall_seconds: float) -> dict:
    """One run's phases per step from its MLflow store, their medians over steps 1.., and
    generation time per completion token (completions differ in length once the methods'
    policies differ; at step 0 policy and completions are identical)."""
    phases = PHASES + (LOGRA_PHASES if mode.startswith("logra") else ())
    steps = {phase: [value for _, value in metric_history(database, mode, f"perf/{phase}_s")] for phase in phases}
    lengths = [value for _, value in metric_history(database, mode, "completion/length_mean")]
    return {
        "wall_seconds": wall_seconds, "per_step": steps, "completion_length_mean": lengths,
        "median_s": {phase: statistics.median(values[1:]) for phase, values in steps.items()},
        "generation_s_per_token": statistics.median(g / n for g, n in zip(steps["generation"][1:], lengths[1:])),
    }


def step_seconds(mode: dict) -> float:
    return sum(mode["median_s"][phase] for phase in PHASES)


def render(result: dict) -> str:
    modes = result["modes"]
    lines = [
        "| mode | " + " | ".join(PHASES) + " | step (sum) | run wall s |",
        "|---|" + "---:|" * (len(PHASES) + 2),
    ]
    for name, mode in modes.items():
        cells = [f"{mode['median_s'][phase]:.2f}" for phase in PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {step_seconds(mode):.2f} | {mode['wall_seconds']:.0f} |")
    logra, dense, lora = modes["logra"], modes["dense"], modes["lora"]
    lines += [
        "",
        *(f"{name}'s update, median s per step: " + ", ".join(f"{p} {mode['median_s'][p]:.2f}" for p in LOGRA_PHASES) + "."
          for name, mode in modes.items() if name.startswith("logra")),
        "",
        f"LoGRA / dense AdamW, step: **{step_seconds(logra) / step_seconds(dense):.3f}**; whole run: "
        f"{logra['wall_seconds'] / dense['wall_seconds']:.3f}. LoGRA / LoRA, step: "
        f"{step_seconds(logra) / step_seconds(lora):.3f}; whole run: {logra['wall_seconds'] / lora['wall_seconds']:.3f}.",
        "",
        "LoGRA minus dense AdamW, median s per step: "
        + ", ".join(f"{phase} {logra['median_s'][phase] - dense['median_s'][phase]:+.2f}" for phase in PHASES) + ".",
        *(f"{name} / dense AdamW, step: **{step_seconds(mode) / step_seconds(dense):.3f}**; whole run: "
          f"{mode['wall_seconds'] / dense['wall_seconds']:.3f}; / LoRA, step: {step_seconds(mode) / step_seconds(lora):.3f}; "
          f"whole run: {mode['wall_seconds'] / lora['wall_seconds']:.3f}."
          for name, mode in modes.items() if name.startswith("logra_")),
        "",
        "Generation at step 0 (the same policy, prompts and completions in every mode): "
        + ", ".join(f"{name} {mode['per_step']['generation'][0]:.2f} s" for name, mode in modes.items())
        + ". Median generation seconds per mean completion token: "
        + ", ".join(f"{name} {mode['generation_s_per_token']:.3f}" for name, mode in modes.items())
        + " (median completion length: "
        + ", ".join(f"{name} {statistics.median(mode['completion_length_mean'][1:]):.1f}" for name, mode in modes.items()) + " tokens).",
        "",
        machine_line(result["machine"]) + f"; command `{result['command']}`; {result['runtime_s']:.0f} s in all.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    modes = result["modes"]
    figure, axis = plt.subplots(figsize=(6, 4))
    parts = {phase: [modes[m]["median_s"][phase] for m in modes] for phase in PHASES}
    stacked_bars(axis, list(modes), parts)
    axis.set_ylabel("median seconds per RL step")
    save_figure(figure, path, title=f"Quickstart step phases ({cpu_caption(result['machine'])})")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--work", type=Path, default=Path("lightning_logs/phases"), help="run logs and MLflow store")
    args = parser.parse_args()
    stem = args.out / "phases"
    if args.render:
        result = load_json(args.render)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        result = {"benchmark": "phases", "command": command_line("phases"), "machine": machine_info(), "code": code_version(),
                  **measure(args.work.resolve())}
        result["runtime_s"] = time.perf_counter() - started
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
