"""Does LoGRA's KL budget bound how far each step moves the policy on its batch? And what do
the probe and the step-KL measurement cost?

Runs through the ``logra`` CLI, one after the other, without validation (same seeds, same
prompts):

- LoGRA on the quickstart (``configs/quickstart.yaml``: arithmetic:1, budget 2e-3 cosine to
  5e-4), on two-digit sums (the quickstart on ``arithmetic:2+``, the frontier's held-out
  task) and on the code task (``configs/quickstart_code.yaml``: code:2, the same budget),
  with each of our probes (``stratified``: strata of equal tokens; ``weighted``: of equal
  expected KL) and, on the arithmetic tasks, the authors' (``kl_probe: reference``, the
  first 2 responses; on the code task: ``--runs code/reference``, and ``step_kl_rows.py``'s
  exact per-row measurement), measuring ``policy/step_kl`` on every row
  (``logging.step_kl_rows: 0``: only the token draws are noise). Per step: its ratio to
  ``logra/budget``, and the probe's share of the step (``perf/logra_probe_s`` over the step's
  phases, the measurement's own left out).
- The quickstart's three methods (dense AdamW lr 1e-5, LoRA r=256 lr 1e-4, LoGRA) at their
  defaults (``policy/step_kl`` on 4 rows drawn by expected KL): how far each moves the policy per step,
  and what measuring it costs, ``perf/step_kl_s`` over the step's phases.

Target (issue 41): step KL / budget within [0.67, 1.5] on at least 90% of steps, the probe
at most 10% of a step, the default measurement at most 5%. Medians of times leave out the
first step (warm-up). Run it alone on the machine: it measures wall time (``--beside``
records the step KLs of runs beside other jobs, and no shares of time).

    python -m benchmarks.step_kl                          # about 50 minutes on 2 CPU cores
    python -m benchmarks.step_kl --runs code/reference --add   # one run, merged into the JSON
    python -m benchmarks.step_kl --runs addition/weighted --add --beside
    python -m benchmarks.step_kl --render benchmarks/results/step_kl.json
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .cli_runs import fresh_work, metric_history, mlflow_environment, run_logra
from .harness import (argument_parser, code_line, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)
from .frontier_protocol import TASKS
from .phases import PHASES

LOGRA = "--trainer.strategy.init_args.logra"
EVERY_ROW = "--model.init_args.logging.step_kl_rows=0"
ADDITION = TASKS["addition"]["overrides"]  # part 2's held-out task, as the frontier trains it; the same budget
RUNS = {
    "quickstart/reference": ("configs/quickstart.yaml", [f"{LOGRA}.kl_probe=reference", EVERY_ROW]),
    "quickstart/stratified": ("configs/quickstart.yaml", [f"{LOGRA}.kl_probe=stratified", EVERY_ROW]),
    "code/reference": ("configs/quickstart_code.yaml", [f"{LOGRA}.kl_probe=reference", EVERY_ROW]),
    "code/stratified": ("configs/quickstart_code.yaml", [f"{LOGRA}.kl_probe=stratified", EVERY_ROW]),
    "addition/reference": ("configs/quickstart.yaml", [*ADDITION, f"{LOGRA}.kl_probe=reference", EVERY_ROW]),
    "addition/stratified": ("configs/quickstart.yaml", [*ADDITION, f"{LOGRA}.kl_probe=stratified", EVERY_ROW]),
    "quickstart/weighted": ("configs/quickstart.yaml", [f"{LOGRA}.kl_probe=weighted", EVERY_ROW]),
    "code/weighted": ("configs/quickstart_code.yaml", [f"{LOGRA}.kl_probe=weighted", EVERY_ROW]),
    "addition/weighted": ("configs/quickstart.yaml", [*ADDITION, f"{LOGRA}.kl_probe=weighted", EVERY_ROW]),
    "quickstart/dense_default": ("configs/quickstart_dense.yaml", []),
    "quickstart/logra_default": ("configs/quickstart.yaml", []),
    "quickstart/lora_default": ("configs/quickstart_lora.yaml", []),
}
BASELINES = ("quickstart/dense_default", "quickstart/lora_default")  # AdamW: no budget, no probe
DEFAULT_RUNS = [name for name in RUNS if name != "code/reference"]  # on code the authors' probe: step_kl_rows.md
BAND = (0.67, 1.5)  # step KL / budget (issue 41)
INSIDE_TARGET = 0.90
PROBE_LIMIT = 0.10  # of a step
MEASURE_LIMIT = 0.05  # of a step, to be on by default


def measure(work: Path, names: list[str], alone: bool) -> dict:
    environment = mlflow_environment(work)
    database = work / "mlflow.db"
    runs = {}
    for name in names:
        config, extra = RUNS[name]
        run_name = name.replace("/", "_")
        print(f"{name}: {config} {' '.join(extra)}", flush=True)
        seconds = run_logra(["fit", "-c", config, "--trainer.limit_val_batches=0",
                             "--model.init_args.logging.completions_every=0", *extra,
                             f"--trainer.default_root_dir={work}", "--trainer.logger.init_args.experiment_name=step_kl",
                             f"--trainer.logger.init_args.run_name={run_name}"], environment, work / f"{run_name}.log")
        keys = ["policy/step_kl", "reward/mean", "perf/step_kl_s", *(f"perf/{phase}_s" for phase in PHASES)]
        if name not in BASELINES:
            keys += ["logra/budget", "logra/alpha", "logra/predicted_kl_scaled", "perf/logra_probe_s"]
        history = {key: dict(metric_history(database, run_name, key)) for key in keys}
        runs[name] = {"config": config, "arguments": extra, "seconds": seconds, "history": history, "alone": alone,
                      "code": code_version(), "command": command_line("step_kl"), "finished": machine_info()["date_utc"]}
        print("  " + summary_line(name, summarise(runs[name])), flush=True)
    return runs


def summarise(run: dict) -> dict:
    # Steps as ints: a JSON round trip turns them into strings, which sort wrongly.
    history = {key: {int(step): value for step, value in values.items()} for key, values in run["history"].items()}
    steps = sorted(history["policy/step_kl"])
    step_seconds = {s: sum(history[f"perf/{phase}_s"].get(s, 0.0) for phase in PHASES) for s in steps}
    # Shares of a step only from runs alone on the machine (``--beside``: other jobs ran).
    timed = steps[1:] if run.get("alone", True) else []
    summary = {"steps": len(steps), "median_step_kl": statistics.median(history["policy/step_kl"][s] for s in steps),
               "measure_share": _median_or_none([history["perf/step_kl_s"][s] / step_seconds[s] for s in timed])}
    if "logra/budget" in history:
        # Steps whose update moved the policy: a step whose advantages are all 0 (every
        # sample of every prompt scored alike) has nothing to train on, predicts 0 and moves
        # nothing, so no budget bounds it.
        moved = [s for s in steps if history["logra/predicted_kl_scaled"].get(s, 0.0) > 0]
        ratios = [history["policy/step_kl"][s] / history["logra/budget"][s] for s in moved]
        summary.update(ratios=ratios, inside=sum(BAND[0] <= r <= BAND[1] for r in ratios) / len(ratios),
                       median_ratio=statistics.median(ratios), still=len(steps) - len(moved),
                       probe_share=_median_or_none([history["perf/logra_probe_s"][s] / step_seconds[s]
                                                    for s in moved if s in timed]))
    return summary


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _share(value: float | None) -> str:
    return "not timed (beside other jobs)" if value is None else f"{100 * value:.1f}%"


def summary_line(name: str, summary: dict) -> str:
    line = f"{name}: measuring step KL {_share(summary['measure_share'])} of a step"
    if "ratios" in summary:
        line += (f"; step KL / budget median {summary['median_ratio']:.2f}, {100 * summary['inside']:.0f}% of "
                 f"{len(summary['ratios'])} steps that moved in [{BAND[0]}, {BAND[1]}] ({summary['still']} had nothing "
                 f"to train on); probe {_share(summary['probe_share'])}")
    return line


def render(result: dict) -> str:
    lines = ["# Does the KL budget bound the step on the batch? (SmolLM2-135M-Instruct, CPU)", "",
             "`policy/step_kl`: KL(before || after) over every trained position of the update, estimated by k3 at "
             "4 tokens per position drawn from the pre-step policy; on every row (`step_kl_rows: 0`) in the "
             "probe comparisons, on 4 rows (the default; stratified until the weighted rows' runs) in the cost rows.", "",
             "A step whose advantages are all 0 (every sample of each prompt scored alike) trains on nothing and "
             "moves nothing: it is left out of the ratios and counted in the last column.", "",
             "| run | median step KL | step KL / budget, per step that moved | median | steps in [0.67, 1.5] | "
             "probe: share of a step | measuring step KL: share of a step | steps with nothing to train on |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, run in result["runs"].items():
        s = summarise(run)
        if "ratios" in s:
            ratios = " ".join(f"{r:.2f}" for r in s["ratios"])
            lines.append(f"| {name} | {s['median_step_kl']:.2e} | {ratios} | {s['median_ratio']:.2f} | {100 * s['inside']:.0f}% "
                         f"({sum(BAND[0] <= r <= BAND[1] for r in s['ratios'])}/{len(s['ratios'])}) | "
                         f"{_share(s['probe_share'])} | {_share(s['measure_share'])} | {s['still']} |")
        else:
            lines.append(f"| {name} | {s['median_step_kl']:.2e} | - | - | - | - | {_share(s['measure_share'])} | - |")
    lines += ["", f"Targets: at least {100 * INSIDE_TARGET:.0f}% of steps in [{BAND[0]}, {BAND[1]}], the probe at most "
                  f"{100 * PROBE_LIMIT:.0f}% of a step, the default measurement at most {100 * MEASURE_LIMIT:.0f}% "
                  "(times: medians over steps 1+; a step is the sum of its phases, the measurement's own left out).",
              f"{machine_line(result['machine'])}. Runs, commits and commands:"]
    for name, run in result["runs"].items():
        lines.append(f"- {name}: {code_line(run['code'])} `{run['command']}`, finished {run['finished']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4))
    styles = {"reference": "--", "stratified": "-", "weighted": ":"}
    colours = {"quickstart": "tab:green", "addition": "tab:orange", "code": "tab:purple"}
    for name, run in result["runs"].items():
        task, probe = name.split("/")
        if probe not in styles:
            continue
        ratios = summarise(run)["ratios"]
        axis.plot(range(len(ratios)), ratios, styles[probe], marker="o", color=colours[task], label=name)
    axis.axhspan(*BAND, color="0.9", label="target band")
    axis.axhline(1.0, color="0.5", linewidth=0.8)
    axis.set(xlabel="update (those that moved)", ylabel="policy/step_kl / budget (every row)")
    axis.legend(fontsize=8)
    save_figure(figure, path, f"LoGRA, 4 prompts x 8 samples - {cpu_caption(result['machine'])}, {result['command']}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--add", action="store_true", help="merge these runs into the existing JSON")
    parser.add_argument("--beside", action="store_true",
                        help="other jobs share the machine: record step KLs, not shares of a step's time")
    args = parser.parse_args()
    stem = args.out / "step_kl"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    names = args.runs.split(",")
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    path = stem.with_suffix(".json")
    result = load_json(path) if args.add and path.exists() else {"runs": {}}
    result["runs"].update(measure(fresh_work("step_kl"), names, alone=not args.beside))
    result["runs"] = {name: result["runs"][name] for name in RUNS if name in result["runs"]}
    result.update(command=command_line("step_kl"), machine=machine_info(), code=code_version())
    save_json(path, result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
