"""How far each optimizer step moves the policy, per method, and what measuring it costs.

The quickstart's three methods (``configs/quickstart_dense.yaml``: AdamW lr 1e-5;
``quickstart_lora.yaml``: LoRA r=256; ``quickstart.yaml``: LoGRA, rank auto = 64, KL budget
2e-3 cosine to 5e-4) run through the ``logra`` CLI with ``logging.step_kl: true`` and no
validation, one after the other (same seeds, same prompts). Per step: ``policy/step_kl``
(k3 on the step's own trained tokens: see the metrics guide), LoGRA's scaled prediction
``logra/predicted_kl_scaled``, and the measurement's cost, ``perf/step_kl_s`` over the
step's summed phases. Medians leave out the first step (warm-up).

    python -m benchmarks.step_kl      # about 15 minutes on 2 CPU cores, alone
    python -m benchmarks.step_kl --render benchmarks/results/step_kl.json
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .cli_runs import fresh_work, metric_history, mlflow_environment, run_logra
from .harness import (argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)
from .phases import PHASES as STEP_PHASES

RUNS = {"dense": "configs/quickstart_dense.yaml", "lora": "configs/quickstart_lora.yaml", "logra": "configs/quickstart.yaml"}
PHASES = (*STEP_PHASES, "step_kl")  # a step's phases as GRPOModule logs them, and the measurement's own
STEPS = 8
COST_LIMIT = 0.10  # on by default only if it costs at most this share of a step (issue 26)


def measure(work: Path, steps: int) -> dict:
    environment = mlflow_environment(work)
    runs = {}
    for name, config in RUNS.items():
        print(f"{name}: {steps} steps with logging.step_kl", flush=True)
        seconds = run_logra(["fit", "-c", config, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
                             "--model.init_args.logging.step_kl=true", "--model.init_args.logging.completions_every=0",
                             f"--trainer.default_root_dir={work}", "--trainer.logger.init_args.experiment_name=step_kl",
                             f"--trainer.logger.init_args.run_name={name}"], environment, work / f"{name}.log")
        database = work / "mlflow.db"
        history = {key: [value for _, value in metric_history(database, name, key)]
                   for key in ("policy/step_kl", "reward/mean", *(f"perf/{phase}_s" for phase in PHASES))}
        if name == "logra":
            history["logra/predicted_kl_scaled"] = [v for _, v in metric_history(database, name, "logra/predicted_kl_scaled")]
        step_seconds = [sum(history[f"perf/{phase}_s"][i] for phase in PHASES) for i in range(steps)]
        runs[name] = {"config": config, "seconds": seconds, "history": history, "step_seconds": step_seconds,
                      "median_step_kl": statistics.median(history["policy/step_kl"][1:]),
                      "cost_share": statistics.median(kl / step for kl, step in
                                                      zip(history["perf/step_kl_s"][1:], step_seconds[1:]))}
        print(f"  step KL median {runs[name]['median_step_kl']:.2e}, cost {100 * runs[name]['cost_share']:.1f}% "
              f"of a step", flush=True)
    return runs


def render(result: dict) -> str:
    lines = ["# How far each step moves the policy (quickstart, SmolLM2-135M-Instruct, CPU)", "",
             "| method | policy/step_kl per step | median (steps 1+) | measuring it: share of the step |",
             "|---|---|---:|---:|"]
    for name, run in result["runs"].items():
        values = " ".join(f"{v:.1e}" for v in run["history"]["policy/step_kl"])
        lines.append(f"| {name} | {values} | {run['median_step_kl']:.2e} | {100 * run['cost_share']:.1f}% |")
    logra = result["runs"].get("logra")
    if logra:
        predicted = " ".join(f"{v:.1e}" for v in logra["history"]["logra/predicted_kl_scaled"])
        lines += ["", f"LoGRA's own scaled prediction per step (`logra/predicted_kl_scaled`, the probe's rows): {predicted}."]
    worst = max(run["cost_share"] for run in result["runs"].values())
    lines += ["", f"Largest cost share {100 * worst:.1f}% (on by default only at <= {100 * COST_LIMIT:.0f}%: "
                  f"{'within' if worst <= COST_LIMIT else 'over'}; `logging.step_kl` stays off by default, on in the "
                  "benchmarks).",
              f"{machine_line(result['machine'])}; {result['steps']} steps per method, no validation; command: "
              f"`{result['command']}`."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.8))
    colours = {"dense": "tab:blue", "lora": "tab:orange", "logra": "tab:green"}
    for name, run in result["runs"].items():
        axis.plot(range(len(run["history"]["policy/step_kl"])), run["history"]["policy/step_kl"], marker="o",
                  color=colours[name], label=f"{name}: policy/step_kl")
    if "logra" in result["runs"]:
        predicted = result["runs"]["logra"]["history"]["logra/predicted_kl_scaled"]
        axis.plot(range(len(predicted)), predicted, linestyle="--", color=colours["logra"], label="logra: predicted (scaled)")
    axis.set(yscale="log", xlabel="optimizer step", ylabel="KL(before || after) per token")
    save_figure(figure, path, f"quickstart, 4 x 8 samples - {cpu_caption(result['machine'])}, {result['command']}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    stem = args.out / "step_kl"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    result = {"runs": measure(fresh_work("step_kl"), args.steps), "steps": args.steps, "command": command_line("step_kl"),
              "machine": machine_info(), "code": code_version()}
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
