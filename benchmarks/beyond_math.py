"""Beyond math: the code task and the tool task, LoGRA vs dense AdamW, 12 steps each.

The shipped configs run unchanged through the ``logra`` CLI (SmolLM2-135M-Instruct, CPU):

- code: ``configs/quickstart_code.yaml`` / ``quickstart_code_dense.yaml``: the built-in
  ``code:2`` task, 4 prompts x 8 samples per step, scored by ``code_execution_reward`` (the
  fraction of the row's hidden tests the sandboxed program passes);
- tools: ``configs/quickstart_tools.yaml`` / ``quickstart_tools_dense.yaml``: three-digit
  arithmetic with a calculator tool, 2 prompts x 8 conversations per step, scored by the
  math reward on the final answer.

Per task, first the untrained model is validated (the same 24 validation prompts x 4
samples the runs validate on at steps 6 and 12; seed 0 everywhere, so LoGRA and dense draw
the same prompts), then each method trains 12 steps. Recorded per run: the training reward
per step, validation pass@1 (a sample passes when its reward is above 0: for the code
reward, one test of five), the tool-call rate and turns per sample (tools), and seconds:
the run's wall clock and the median step (the gap between consecutive steps' metrics; the
two gaps that hold a validation are left out).

    python -m benchmarks.beyond_math                 # about 50 minutes on 2 CPU cores, alone
    python -m benchmarks.beyond_math --tasks code    # one task (results merged into the file)
    python -m benchmarks.beyond_math --render benchmarks/results/beyond_math.json

Run logs and the MLflow store stay in ``lightning_logs/beyond_math``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .cli_runs import fresh_work, mlflow_environment, run_logra, timed_metric_history
from .harness import (argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)

CONFIGS = {
    "code": {"logra": "configs/quickstart_code.yaml", "dense": "configs/quickstart_code_dense.yaml"},
    "tools": {"logra": "configs/quickstart_tools.yaml", "dense": "configs/quickstart_tools_dense.yaml"},
}
METRICS = {"code": ("reward/mean", "completion/length_mean"),
           "tools": ("reward/mean", "completion/length_mean", "tools/calls_per_sample", "turns/mean", "tools/failures")}


def run_name(task: str, method: str) -> str:
    return f"{task}-{method}"


def measure_task(task: str, work: Path) -> dict:
    environment = mlflow_environment(work)
    common = ["--trainer.logger.init_args.experiment_name=beyond_math", f"--trainer.default_root_dir={work}"]
    database = work / "mlflow.db"

    name = run_name(task, "untrained")
    print(f"{name}: validating the untrained model", flush=True)
    seconds = run_logra(["validate", "-c", CONFIGS[task]["dense"], *common, f"--trainer.logger.init_args.run_name={name}"],
                        environment, work / f"{name}.log")
    untrained = {"pass_at_1": timed_metric_history(database, name, "val/pass_at_1")[-1][1], "seconds": seconds}
    print(f"  pass@1 {untrained['pass_at_1']:.3f} ({seconds:.0f} s)", flush=True)

    runs = {}
    for method, config in CONFIGS[task].items():
        name = run_name(task, method)
        print(f"{name}: fit -c {config}", flush=True)
        seconds = run_logra(["fit", "-c", config, *common, f"--trainer.logger.init_args.run_name={name}"],
                            environment, work / f"{name}.log")
        curves = {key: timed_metric_history(database, name, key) for key in (*METRICS[task], "val/pass_at_1")}
        runs[method] = {"config": config, "seconds": seconds, "curves": curves,
                        "median_step_s": median_step_seconds(curves["reward/mean"], curves["val/pass_at_1"])}
        run = runs[method]
        print(f"  reward {curves['reward/mean'][0][1]:.3f} -> {final_reward(run):.3f}, val pass@1 "
              f"{' '.join(f'{v:.3f}' for _, v, _ in curves['val/pass_at_1'])}, {run['median_step_s']:.1f} s/step, "
              f"{seconds:.0f} s", flush=True)
    return {"untrained": untrained, "runs": runs}


def median_step_seconds(reward: list, validation: list) -> float:
    """The median gap between consecutive steps' logged rewards, validation gaps left out."""
    validated = {seconds for _, _, seconds in validation}
    gaps = [later[2] - earlier[2] for earlier, later in zip(reward, reward[1:])
            if not any(earlier[2] < seconds <= later[2] for seconds in validated)]
    return statistics.median(gaps)


def final_reward(run: dict, last: int = 3) -> float:
    """The mean training reward of the last ``last`` steps (one step's 16-32 samples are noisy)."""
    return statistics.mean(value for _, value, _ in run["curves"]["reward/mean"][-last:])


def first_reward(run: dict, first: int = 3) -> float:
    return statistics.mean(value for _, value, _ in run["curves"]["reward/mean"][:first])


def render(result: dict) -> str:
    lines = ["# Beyond math: the code and tool tasks, LoGRA vs dense AdamW (SmolLM2-135M-Instruct, CPU)", ""]
    for task, entry in result["tasks"].items():
        untrained = entry["untrained"]["pass_at_1"]
        lines += [f"## {task}", "",
                  "| method | reward, steps 0-2 | reward, last 3 steps | val pass@1: step 0 / 6 / 12 |"
                  + (" tool calls per sample, steps 0-2 / last 3 | turns per sample, last 3 |" if task == "tools" else "")
                  + " median s/step | run s |",
                  "|---|---:|---:|---|" + ("---:|---:|" if task == "tools" else "") + "---:|---:|"]
        for method, run in entry["runs"].items():
            validation = " / ".join(f"{value:.3f}" for value in [untrained] + [v for _, v, _ in run["curves"]["val/pass_at_1"]])
            row = f"| {method} | {first_reward(run):.3f} | {final_reward(run):.3f} | {validation} |"
            if task == "tools":
                calls = [v for _, v, _ in run["curves"]["tools/calls_per_sample"]]
                turns = [v for _, v, _ in run["curves"]["turns/mean"]]
                row += (f" {statistics.mean(calls[:3]):.2f} / {statistics.mean(calls[-3:]):.2f} |"
                        f" {statistics.mean(turns[-3:]):.2f} |")
            lines.append(row + f" {run['median_step_s']:.1f} | {run['seconds']:.0f} |")
        lines += ["", f"The untrained model's validation took {entry['untrained']['seconds']:.0f} s.", ""]
    lines += [f"{machine_line(result['machine'])}; command: `{result['command']}`."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    tasks = list(result["tasks"])
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    colours = {"dense": "tab:blue", "logra": "tab:green"}
    for axis, task in zip(axes[0], tasks):
        entry = result["tasks"][task]
        for method, run in entry["runs"].items():
            steps = [step for step, _, _ in run["curves"]["reward/mean"]]
            axis.plot(steps, [v for _, v, _ in run["curves"]["reward/mean"]], color=colours[method], alpha=0.6,
                      label=f"{method}: training reward")
            validation = [(0, entry["untrained"]["pass_at_1"])] + [(s, v) for s, v, _ in run["curves"]["val/pass_at_1"]]
            axis.plot(*zip(*validation), color=colours[method], marker="o", linestyle="--", label=f"{method}: val pass@1")
        axis.set(title=task, xlabel="optimizer step", ylabel="reward / pass@1")
    save_figure(figure, path, f"SmolLM2-135M-Instruct, seed 0 - {cpu_caption(result['machine'])}, {result['command']}",
                legend_fontsize=7)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tasks", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args()
    stem = args.out / "beyond_math"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    result = load_json(stem.with_suffix(".json")) if stem.with_suffix(".json").exists() else {"tasks": {}}
    started = time.perf_counter()
    for task in args.tasks:
        result["tasks"][task] = measure_task(task, fresh_work(f"beyond_math/{task}"))
    result.update(command=command_line("beyond_math"), machine=machine_info(), code=code_version(),
                  seconds=time.perf_counter() - started)
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
