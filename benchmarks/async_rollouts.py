"""One-step-off-policy rollouts against the synchronous loop, on the quickstart, on this machine.

Each seed trains the quickstart (``configs/quickstart.yaml``, LoGRA) for 24 steps twice,
one run after the other, alone on the machine:

- ``sync``: ``rollout.max_staleness: 0``, one process generating and training on every core
  torch uses by default;
- ``async``: ``rollout.max_staleness: 1``, the trainer on one thread (``OMP_NUM_THREADS=1``)
  and the rollout worker process on another (``rollout.worker_threads: 1``): the worker
  samples batch k+1 while the trainer trains on batch k.

Validation is off (``limit_val_batches: 0``): the comparison is the training loop. Seconds
per step: the wall time between the MLflow stamps of step 1 and the last step, over the
steps between (step 0 holds start-up: the worker's model load and its first generation,
which the trainer waits for). Per phase: the mean of each ``perf/<phase>_s`` over the same
steps (``generation`` is, for ``async``, the time the trainer waited for the worker). The
reward curve of each ``async`` seed is compared with the band (min-max) of the ``sync``
seeds at every step. Then a 2-step one-step-off run of each method's quickstart config
(LoGRA, dense, LoRA r=256) reports the bytes one weight sync sends the worker.

    python -m benchmarks.async_rollouts                   # 3 seeds x both modes
    python -m benchmarks.async_rollouts --seeds 0 --steps 4 --out /tmp/async   # a smoke run
    python -m benchmarks.async_rollouts --render benchmarks/results/async_rollouts.json

Run logs and the MLflow store stay in ``lightning_logs/async_rollouts``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .cli_runs import fresh_work, mlflow_environment, run_logra, timed_metric_history
from .harness import (argument_parser, code_line, code_version, command_line, cpu_caption, load_json, machine_info,
                      machine_line, pyplot, save_figure, save_json, write_outputs)

CONFIG = "configs/quickstart.yaml"
MODES = {
    "sync": {"overrides": ["--model.init_args.rollout.max_staleness=0"], "environment": {}},
    "async": {"overrides": ["--model.init_args.rollout.max_staleness=1", "--model.init_args.rollout.worker_threads=1"],
              "environment": {"OMP_NUM_THREADS": "1"}},
}
# What one sync sends the worker, per method (a 2-step one-step-off run of each quickstart config).
BYTES_CONFIGS = {"logra": CONFIG, "dense": "configs/quickstart_dense.yaml", "lora": "configs/quickstart_lora.yaml"}
PHASES = ("generation", "rewards", "forward_backward", "optimizer_step", "weight_sync")
TARGET = 0.85  # async seconds per step / sync's


def train(mode: str, seed: int, steps: int, work: Path) -> dict:
    name = f"{mode}_seed{seed}"
    overrides = [*MODES[mode]["overrides"], f"--seed_everything={seed}", f"--model.init_args.seed={seed}",
                 f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
                 f"--trainer.default_root_dir={work / name}", "--trainer.logger.init_args.experiment_name=async_rollouts",
                 f"--trainer.logger.init_args.run_name={name}"]
    print(f"{name}: logra fit -c {CONFIG} {' '.join(overrides[:2])} ...", flush=True)
    environment = {**mlflow_environment(work), **MODES[mode]["environment"]}
    seconds = run_logra(["fit", "-c", CONFIG, *overrides], environment, work / f"{name}.log")
    database = work / "mlflow.db"
    reward = timed_metric_history(database, name, "reward/mean")
    stamps = [stamp for _, _, stamp in reward]
    per_step = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    phases = {phase: statistics.fmean(value for step, value, _ in timed_metric_history(database, name, f"perf/{phase}_s")
                                      if step >= 1) for phase in PHASES}
    sync_bytes = [value for _, value, _ in timed_metric_history(database, name, "perf/weight_sync_bytes")] \
        if mode == "async" else []
    print(f"  {per_step:.2f} s per step; reward {reward[0][1]:.3f} -> {reward[-1][1]:.3f} ({seconds:.0f} s)", flush=True)
    return {"mode": mode, "seed": seed, "seconds": seconds, "seconds_per_step": per_step, "phases": phases,
            "reward": [value for _, value, _ in reward], "sync_bytes": sync_bytes[0] if sync_bytes else None}


def sync_bytes(method: str, work: Path) -> dict:
    """Bytes of each weight sync of a 2-step one-step-off run of ``method``'s quickstart config."""
    name = f"bytes_{method}"
    overrides = ["--model.init_args.rollout.max_staleness=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                 f"--trainer.default_root_dir={work / name}", "--trainer.logger.init_args.experiment_name=async_rollouts",
                 f"--trainer.logger.init_args.run_name={name}"]
    run_logra(["fit", "-c", BYTES_CONFIGS[method], *overrides], mlflow_environment(work), work / f"{name}.log")
    values = [value for _, value, _ in timed_metric_history(work / "mlflow.db", name, "perf/weight_sync_bytes")]
    print(f"{name}: {values[-1] / 2**20:.2f} MiB per sync", flush=True)
    return {"method": method, "config": BYTES_CONFIGS[method], "bytes_per_sync": values[-1]}


def summary(runs: list[dict]) -> dict:
    by_mode = {mode: [run for run in runs if run["mode"] == mode] for mode in MODES}
    if not all(by_mode.values()):
        return {}
    per_step = {mode: statistics.fmean(run["seconds_per_step"] for run in rows) for mode, rows in by_mode.items()}
    paired = [a["seconds_per_step"] / s["seconds_per_step"] for a in by_mode["async"] for s in by_mode["sync"]
              if a["seed"] == s["seed"]]
    low = [min(values) for values in zip(*(run["reward"] for run in by_mode["sync"]))]
    high = [max(values) for values in zip(*(run["reward"] for run in by_mode["sync"]))]
    inside = [sum(lo <= value <= hi for value, lo, hi in zip(run["reward"], low, high)) / len(low)
              for run in by_mode["async"]]
    below = [sum(value < lo for value, lo in zip(run["reward"], low)) for run in by_mode["async"]]
    above = [sum(value > hi for value, hi in zip(run["reward"], high)) for run in by_mode["async"]]
    reward_gap = [statistics.fmean(a["reward"]) - statistics.fmean(s["reward"]) for a in by_mode["async"]
                  for s in by_mode["sync"] if a["seed"] == s["seed"]]
    return {"seconds_per_step": per_step, "ratio_per_seed": paired, "ratio": statistics.fmean(paired),
            "target": TARGET, "met": statistics.fmean(paired) <= TARGET,
            "reward_inside_sync_band": inside, "steps_below_sync_band": below, "steps_above_sync_band": above,
            "mean_reward_gap_per_seed": reward_gap, "mean_reward": {mode: statistics.fmean(
                statistics.fmean(run["reward"]) for run in rows) for mode, rows in by_mode.items()}}


def render(result: dict) -> str:
    lines = ["# One-step-off-policy rollouts vs the synchronous loop (quickstart, CPU)", "",
             f"`{result['command']}` at {code_line(result['code'])}; {machine_line(result['machine'])}.", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "",
             "| mode | seed | s / step | " + " | ".join(f"{phase} s" for phase in PHASES) + " | mean reward | sync bytes |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
    for run in result["runs"]:
        phases = " | ".join(f"{run['phases'][phase]:.2f}" for phase in PHASES)
        sync_bytes = "-" if run["sync_bytes"] is None else f"{run['sync_bytes'] / 2**20:.2f} MiB"
        lines.append(f"| {run['mode']} | {run['seed']} | {run['seconds_per_step']:.2f} | {phases} | "
                     f"{statistics.fmean(run['reward']):.3f} | {sync_bytes} |")
    if result.get("sync_bytes"):
        full = next(row["bytes_per_sync"] for row in result["sync_bytes"] if row["method"] == "dense")
        lines += ["", "What each sync sends the worker (SmolLM2-135M, float32): "
                  + "; ".join(f"{row['method']} {row['bytes_per_sync'] / 2**20:.2f} MiB "
                              f"({row['bytes_per_sync'] / full:.3f} of dense)" for row in result["sync_bytes"]) + "."]
    found = result.get("summary")
    if found:
        verdict = "met" if found["met"] else "MISSED"
        lines += ["", f"Seconds per step, async / sync, paired by seed: "
                      f"{', '.join(f'{r:.2f}' for r in found['ratio_per_seed'])} (mean {found['ratio']:.2f}; target "
                      f"<= {found['target']}: {verdict}). Share of steps where each async seed's reward lies inside "
                      f"the sync seeds' band (min-max): {', '.join(f'{s:.2f}' for s in found['reward_inside_sync_band'])}; "
                      f"steps below it: {', '.join(map(str, found['steps_below_sync_band']))}, above it: "
                      f"{', '.join(map(str, found['steps_above_sync_band']))} (of {result['steps']}). Mean reward over "
                      f"the steps, async - sync, paired by seed: "
                      f"{', '.join(f'{g:+.3f}' for g in found['mean_reward_gap_per_seed'])}."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        curves.plot(run["reward"], color="C0" if run["mode"] == "sync" else "C1", alpha=0.7,
                    label=f"{run['mode']} seed {run['seed']}")
    curves.set_xlabel("step")
    curves.set_ylabel("reward/mean")
    labels = [f"{run['mode']} {run['seed']}" for run in result["runs"]]
    bottom = [0.0] * len(labels)
    for phase in PHASES:
        values = [run["phases"][phase] for run in result["runs"]]
        bars.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    bars.plot(labels, [run["seconds_per_step"] for run in result["runs"]], "k_", markersize=20, label="s / step")
    bars.set_ylabel("seconds per step")
    bars.tick_params(axis="x", rotation=45)
    curves.legend(fontsize=7)
    save_figure(figure, path, title=f"async vs sync rollouts ({cpu_caption(result['machine'])})")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    if args.render:
        result = load_json(args.render)
        write_outputs(args.render.with_suffix(""), result, render, plot)
        return
    work = fresh_work("async_rollouts")
    started = time.perf_counter()
    runs = [train(mode, seed, args.steps, work) for seed in args.seeds for mode in MODES]
    payloads = [sync_bytes(method, work) for method in BYTES_CONFIGS]
    result = {"command": command_line("benchmarks.async_rollouts"), "code": code_version(), "machine": machine_info(),
              "steps": args.steps, "runs": runs, "summary": summary(runs), "sync_bytes": payloads,
              "seconds": time.perf_counter() - started}
    save_json(args.out / "async_rollouts.json", result)
    write_outputs(args.out / "async_rollouts", result, render, plot)


if __name__ == "__main__":
    main()
