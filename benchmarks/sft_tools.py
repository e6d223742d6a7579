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
RL_CURVES = ("reward/mean", "tools/calls_per_sample", "turns/mean", *VALIDATION)


def validate(config: str, name: str, work: Path, *overrides: str) -> dict:
    """``logra validate`` of ``config``: its validation pass@1 and tool-call rate, seconds."""
    environment, database = mlflow_environment(work), work / "mlflow.db"
    print(f"{name}: validate -c {config} {' '.join(overrides)}", flush=True)
    seconds = run_logra(["validate", "-c", config, *overrides, f"--trainer.default_root_dir={work / name}",
                         "--trainer.logger.init_args.experiment_name=sft_tools",
                         f"--trainer.logger.init_args.run_name={name}"], environment, work / f"{name}.log")
    result = {key: timed_metric_history(database, name, key)[-1][1] for key in VALIDATION}
    print(f"  pass@1 {result['val/pass_at_1']:.3f}, tool calls per sample "
          f"{result['val/tools/calls_per_sample']:.2f} ({seconds:.0f} s)", flush=True)
    return {**result, "seconds": seconds}


def fit(config: str, name: str, work: Path, curves: tuple[str, ...], *overrides: str) -> dict:
    environment, database = mlflow_environment(work), work / "mlflow.db"
    print(f"{name}: fit -c {config} {' '.join(overrides)}", flush=True)
    seconds = run_logra(["fit", "-c", config, *overrides, f"--trainer.default_root_dir={work / name}",
                         "--trainer.logger.init_args.experiment_name=sft_tools",
                         f"--trainer.logger.init_args.run_name={name}"], environment, work / f"{name}.log")
    history = {key: [(step, value) for step, value, _ in timed_metric_history(database, name, key)] for key in curves}
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
    configs = CONFIGS[method]
    started = time.time()
    sft = fit(configs["sft"], f"{method}-sft", work, SFT_CURVES)
    model = work / f"{method}-sft" / "model"
    checkpoint = checkpoint_folder(work / f"{method}-sft") / "last.ckpt"
    if not checkpoint.exists() or checkpoint.stat().st_mtime < started:
        raise SystemExit(f"{checkpoint} was not written by this run: remove the folder's old checkpoints, which "
                         "ModelCheckpoint would version around (last-v1.ckpt), and run again")
    print(f"{method}: export {checkpoint} -> {model}", flush=True)
    run_logra(["export", "--ckpt_path", str(checkpoint), "--out", str(model), "--overwrite"], mlflow_environment(work),
              work / f"{method}-export.log")
    after_sft = validate(configs["rl"], f"{method}-after-sft", work, f"--model.init_args.model={model}")
    rl = fit(configs["rl"], f"{method}-rl", work, RL_CURVES, f"--model.init_args.model={model}")
    return {"sft": sft, "after_sft": after_sft, "rl": rl}


def render(result: dict) -> str:
    untrained = result["untrained"]
    lines = ["# A tool task that learns: SFT warm start, then RL (SmolLM2-135M-Instruct, CPU, seed 0)", "",
             "Validation: the tool task's 24 held-out prompts x 4 conversations. Tool calls per conversation / "
             "pass@1 at each stage.", "",
             "| method | untrained | after SFT | RL step 6 | RL step 12 | SFT loss: first -> last (val) | "
             "RL reward, steps 0-2 -> last 3 | RL tool calls per sample, steps 0-2 -> last 3 | SFT s | RL s |",
             "|---|---|---|---|---|---|---|---|---:|---:|"]

    def stage(values: dict) -> str:
        return f"{values['val/tools/calls_per_sample']:.2f} / {values['val/pass_at_1']:.3f}"

    for method, run in result["runs"].items():
        rl, sft = run["rl"]["curves"], run["sft"]["curves"]
        rl_stages = [{key: rl[key][index][1] for key in VALIDATION} for index in range(len(rl["val/pass_at_1"]))]
        reward = [value for _, value in rl["reward/mean"]]
        calls = [value for _, value in rl["tools/calls_per_sample"]]
        loss = [value for _, value in sft["train/loss"]]
        lines.append(
            f"| {method} | {stage(untrained)} | {stage(run['after_sft'])} | "
            + " | ".join(stage(values) for values in rl_stages)
            + f" | {loss[0]:.3f} -> {loss[-1]:.3f} ({sft['val/loss'][-1][1]:.3f}) | "
            f"{sum(reward[:3]) / 3:.3f} -> {sum(reward[-3:]) / 3:.3f} | {sum(calls[:3]) / 3:.2f} -> "
            f"{sum(calls[-3:]) / 3:.2f} | {run['sft']['seconds']:.0f} | {run['rl']['seconds']:.0f} |")
    lines += ["", f"{machine_line(result['machine'])}; code {result['code']}; command: `{result['command']}`."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, (loss_axis, rl_axis) = plt.subplots(1, 2, figsize=(12, 4))
    colours = {"dense": "tab:blue", "logra": "tab:green"}
    for method, run in result["runs"].items():
        sft, rl = run["sft"]["curves"], run["rl"]["curves"]
        loss_axis.plot(*zip(*sft["train/loss"]), color=colours[method], label=f"{method}: train loss")
        loss_axis.plot(*zip(*sft["val/loss"]), color=colours[method], marker="o", linestyle="--",
                       label=f"{method}: val loss")
        rl_axis.plot(*zip(*rl["reward/mean"]), color=colours[method], alpha=0.6, label=f"{method}: RL reward")
        stages = [(-1, run["after_sft"]["val/pass_at_1"])] + list(rl["val/pass_at_1"])
        rl_axis.plot(*zip(*stages), color=colours[method], marker="o", linestyle="--",
                     label=f"{method}: val pass@1 (step -1: after SFT)")
    rl_axis.axhline(result["untrained"]["val/pass_at_1"], color="grey", linestyle=":", label="untrained val pass@1")
    loss_axis.set(title="SFT on calculator conversations", xlabel="step", ylabel="NLL per assistant token")
    rl_axis.set(title="RL on the tool task from the SFT model", xlabel="RL step", ylabel="reward / pass@1")
    save_figure(figure, path, f"SmolLM2-135M-Instruct, seed 0 - {cpu_caption(result['machine'])}, {result['command']}",
                legend_fontsize=7)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--methods", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
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
        result["runs"][method] = measure(method, work)
        result.update(command=command_line("sft_tools"), machine=machine_info(), code=code_version(),
                      seconds=time.perf_counter() - started)
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
