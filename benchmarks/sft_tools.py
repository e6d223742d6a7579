"""A tool task that learns: SFT warm start, then RL, LoGRA and dense AdamW, one seed.

SmolLM2-135M-Instruct never calls the calculator of ``configs/quickstart_tools.yaml`` (0 of
192 conversations per run, ``beyond_math``), so RL there has no signal. Here each method
first fine-tunes it on correct calculator-calling conversations (``configs/sft_tools.yaml``
/ ``sft_tools_dense.yaml``: the built-in ``calculator:3`` source, drawn from the task's
training prompts only), the checkpoint is exported (``logra export``), and RL runs from the
exported folder with the tool task's own config (``quickstart_tools.yaml`` /
``quickstart_tools_dense.yaml``, unchanged but for ``model``).

Measured on the tool task's 24 validation prompts x 4 conversations (the RL configs'
validation, seed 0 everywhere): the tool-call rate (``val/tools/calls_per_sample``) and
pass@1 of the untrained model, after SFT (``logra validate`` on the exported folder) and
after RL (its validations at steps 6 and 12); plus the SFT loss curves and the RL reward
and tool-call curves.

    python -m benchmarks.sft_tools                       # both methods, one after the other
    python -m benchmarks.sft_tools --methods logra       # one (merged into the file)
    python -m benchmarks.sft_tools --budget 96           # validation and RL again from the exported models,
                                                         # with rollout.max_new_tokens 96 (added to the file)
    python -m benchmarks.sft_tools --render benchmarks/results/sft_tools.json

Run logs, checkpoints, the exported models and the MLflow store stay in
``lightning_logs/sft_tools``.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from .cli_runs import mlflow_environment, run_logra, timed_metric_history
from .harness import (ROOT, argument_parser, code_version, command_line, cpu_caption, load_json, machine_info,
                      machine_line, pyplot, save_figure, save_json, write_outputs)

CONFIGS = {
    "logra": {"sft": "configs/sft_tools.yaml", "rl": "configs/quickstart_tools.yaml"},
    "dense": {"sft": "configs/sft_tools_dense.yaml", "rl": "configs/quickstart_tools_dense.yaml"},
}
VALIDATION = ("val/pass_at_1", "val/tools/calls_per_sample")
SFT_CURVES = ("train/loss", "val/loss")
RL_CURVES = ("reward/mean", "reward/zero_std_groups", "tools/calls_per_sample", "turns/mean", *VALIDATION)


def run(subcommand: str, config: str, name: str, work: Path, *overrides: str) -> float:
    """``logra <subcommand> -c config`` as MLflow run ``name`` of the work folder's store; seconds."""
    print(f"{name}: {subcommand} -c {config} {' '.join(overrides)}", flush=True)
    return run_logra([subcommand, "-c", config, *overrides, f"--trainer.default_root_dir={work / name}",
                      "--trainer.logger.init_args.experiment_name=sft_tools",
                      f"--trainer.logger.init_args.run_name={name}"], mlflow_environment(work), work / f"{name}.log")


def validate(config: str, name: str, work: Path, *overrides: str) -> dict:
    """``logra validate`` of ``config``: its validation pass@1 and tool-call rate, seconds."""
    seconds = run("validate", config, name, work, *overrides)
    result = {key: timed_metric_history(work / "mlflow.db", name, key)[-1][1] for key in VALIDATION}
    print(f"  pass@1 {result['val/pass_at_1']:.3f}, tool calls per sample "
          f"{result['val/tools/calls_per_sample']:.2f} ({seconds:.0f} s)", flush=True)
    return {**result, "seconds": seconds}


def fit(config: str, name: str, work: Path, curves: tuple[str, ...], *overrides: str) -> dict:
    """``logra fit`` of ``config``: the ``curves`` it logged, seconds."""
    seconds = run("fit", config, name, work, *overrides)
    history = {key: [(step, value) for step, value, _ in timed_metric_history(work / "mlflow.db", name, key)]
               for key in curves}
    print(f"  {', '.join(f'{key} {values[0][1]:.3f} -> {values[-1][1]:.3f}' for key, values in history.items())} "
          f"({seconds:.0f} s)", flush=True)
    return {"config": config, "overrides": list(overrides), "seconds": seconds, "curves": history}


def checkpoint_folder(run: Path) -> Path:
    """Where the run's ModelCheckpoint wrote, from the config it saved (resolved: the YAML's
    interpolations are resolved when it is read, before command-line overrides)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            return ROOT / callback["init_args"]["dirpath"]
    raise SystemExit(f"{run / 'config.yaml'} lists no ModelCheckpoint: nothing to export")


def measure(method: str, work: Path) -> dict:
    """SFT, export, and RL at the tool config's own completion budget."""
    configs = CONFIGS[method]
    started = time.time()
    sft = fit(configs["sft"], f"{method}-sft", work, SFT_CURVES)
    checkpoint = checkpoint_folder(work / f"{method}-sft") / "last.ckpt"
    if not checkpoint.exists() or checkpoint.stat().st_mtime < started:
        raise SystemExit(f"{checkpoint} was not written by this run: remove the folder's old checkpoints, which "
                         "ModelCheckpoint would version around (last-v1.ckpt), and run again")
    print(f"{method}: export {checkpoint} -> {exported(method, work)}", flush=True)
    run_logra(["export", "--ckpt_path", str(checkpoint), "--out", str(exported(method, work)), "--overwrite"],
              mlflow_environment(work), work / f"{method}-export.log")
    return {"sft": sft, **after_sft(method, work)}


def exported(method: str, work: Path) -> Path:
    return work / f"{method}-sft" / "model"


def after_sft(method: str, work: Path, budget: int | None = None) -> dict:
    """Validation of the exported SFT model and RL from it, with the tool config's
    ``rollout.max_new_tokens`` or ``budget``."""
    rl_config, suffix = CONFIGS[method]["rl"], "" if budget is None else f"-{budget}"
    overrides = [f"--model.init_args.model={exported(method, work)}"]
    if budget is not None:
        overrides.append(f"--model.init_args.rollout.max_new_tokens={budget}")
    return {"after_sft": validate(rl_config, f"{method}-after-sft{suffix}", work, *overrides),
            "rl": fit(rl_config, f"{method}-rl{suffix}", work, RL_CURVES, *overrides)}


def rl_runs(result: dict):
    """(method, completion budget, its after-SFT validation and RL run) for every RL run."""
    for method, run in result["runs"].items():
        yield method, "config's (64)", run["after_sft"], run["rl"]
        for budget, entry in run.get("budgets", {}).items():
            yield method, budget, entry["after_sft"], entry["rl"]


def commit(code: dict) -> str:
    return code["git_commit"][:7] + (" (with local changes)" if code["lightning_logra_locally_modified"] else "")


def render(result: dict) -> str:
    def stage(values: dict) -> str:
        return f"{values['val/tools/calls_per_sample']:.2f} / {values['val/pass_at_1']:.3f}"

    def mean(values: list) -> str:
        return f"{sum(values) / len(values):.2f}"

    lines = ["# A tool task that learns: SFT warm start, then RL (SmolLM2-135M-Instruct, CPU, seed 0)", "",
             "## SFT", "",
             "| method | train loss, first -> last step | val loss, step 6 -> 12 | seconds |", "|---|---|---|---:|"]
    for method, run in result["runs"].items():
        sft = run["sft"]["curves"]
        lines.append(f"| {method} | {sft['train/loss'][0][1]:.3f} -> {sft['train/loss'][-1][1]:.3f} | "
                     f"{' -> '.join(f'{value:.3f}' for _, value in sft['val/loss'])} | {run['sft']['seconds']:.0f} |")
    lines += ["", "## Validation before SFT, after SFT and during RL", "",
              "The tool task's 24 held-out prompts x 4 conversations; each cell is tool calls per conversation / "
              "pass@1. The budget is `rollout.max_new_tokens`, the whole completion (calls, tool results, answer).",
              "", "| method | budget | untrained | after SFT | RL step 6 | RL step 12 | RL reward, steps 0-2 -> last 3 | "
              "groups with one reward for all samples (mean over steps) | RL s |",
              "|---|---|---|---|---|---|---|---|---:|"]
    for method, budget, validated, rl in rl_runs(result):
        curves = rl["curves"]
        stages = [{key: curves[key][index][1] for key in VALIDATION} for index in range(len(curves["val/pass_at_1"]))]
        reward = [value for _, value in curves["reward/mean"]]
        same = curves.get("reward/zero_std_groups")
        lines.append(f"| {method} | {budget} | {stage(result['untrained'])} | {stage(validated)} | "
                     + " | ".join(stage(values) for values in stages)
                     + f" | {mean(reward[:3])} -> {mean(reward[-3:])} | "
                     f"{'not recorded' if same is None else mean([value for _, value in same])} | {rl['seconds']:.0f} |")
    lines += ["", machine_line(result["machine"]) + "; commands:", ""]
    lines += [f"- `{entry['command']}` at {commit(entry['code'])} ({entry['seconds']:.0f} s)"
              for entry in result["commands"]]
    lines += [f"- {note}" for note in result.get("notes", [])]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, (loss_axis, rl_axis) = plt.subplots(1, 2, figsize=(12, 4))
    colours = {"dense": "tab:blue", "logra": "tab:green"}
    for method, run in result["runs"].items():
        sft = run["sft"]["curves"]
        loss_axis.plot(*zip(*sft["train/loss"]), color=colours[method], label=f"{method}: train loss")
        loss_axis.plot(*zip(*sft["val/loss"]), color=colours[method], marker="o", linestyle="--",
                       label=f"{method}: val loss")
    for (method, budget, validated, rl), style in zip(rl_runs(result), ["-", "--", ":", "-."] * 4):
        rl_axis.plot(*zip(*rl["curves"]["reward/mean"]), color=colours[method], alpha=0.3, linestyle=style)
        stages = [(-1, validated["val/pass_at_1"])] + list(rl["curves"]["val/pass_at_1"])
        rl_axis.plot(*zip(*stages), color=colours[method], marker="o", linestyle=style,
                     label=f"{method}, budget {budget}: val pass@1 (faint: RL reward)")
    rl_axis.axhline(result["untrained"]["val/pass_at_1"], color="grey", linestyle=":", label="untrained val pass@1")
    loss_axis.set(title="SFT on calculator conversations", xlabel="step", ylabel="NLL per assistant token")
    rl_axis.set(title="RL on the tool task from the SFT model (step -1: after SFT)", xlabel="RL step",
                ylabel="reward / pass@1")
    save_figure(figure, path, f"SmolLM2-135M-Instruct, seed 0 - {cpu_caption(result['machine'])}, "
                f"{result['commands'][-1]['command']}", legend_fontsize=7)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--methods", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--budget", type=int, default=None,
                        help="only the validation and RL after SFT, from the exported models of an earlier run, with "
                             "rollout.max_new_tokens set to this")
    args = parser.parse_args()
    stem = args.out / "sft_tools"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    result = load_json(stem.with_suffix(".json")) if stem.with_suffix(".json").exists() else {"runs": {}}
    work = ROOT / "lightning_logs" / "sft_tools"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if "untrained" not in result:
        result["untrained"] = validate(CONFIGS["dense"]["rl"], "untrained", work)
        save_json(stem.with_suffix(".json"), result)
    for method in args.methods:
        if args.budget is None:
            result["runs"][method] = measure(method, work)
        else:
            result["runs"][method].setdefault("budgets", {})[str(args.budget)] = after_sft(method, work, args.budget)
        save_json(stem.with_suffix(".json"), result)
    result.setdefault("commands", []).append({"command": command_line("sft_tools"), "code": code_version(),
                                              "seconds": time.perf_counter() - started})
    result["machine"] = machine_info()
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
