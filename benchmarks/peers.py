"""The peer users would pick instead: TRL's ``GRPOTrainer`` beside our dense AdamW and LoGRA,
on the quickstart task and model, side by side in one run.

Every method trains SmolLM2-135M-Instruct (float32, CPU) on the quickstart's prompts
(``arithmetic:1``, " Answer with just the number."), 4 prompts x 8 samples per optimizer
step, 16 new tokens at temperature 1 (no top-k / top-p), the quickstart's math reward, no
KL term, no validation, one optimizer step per generation:

- ``trl``: ``trl.GRPOTrainer`` (its own loop: HF generation, ``loss_type="dapo"``, the
  token mean over the step's completions, as ours; ``scale_rewards="group"``; AdamW at
  learning rate 1e-5, constant; 2 micro-batches of 16 completions; no gradient
  checkpointing). Its dataset is our data module's train prompts in the order our run draws
  them (``shuffle_dataset=False``), so step k trains on the same 4 prompts in every method;
- ``dense``: ``logra fit -c configs/quickstart_dense.yaml`` (AdamW, lr 1e-5, constant);
- ``logra``: ``logra fit -c configs/quickstart.yaml`` (rank auto = 64, KL budget 2e-3
  cosine to 5e-4 over the run's steps).

Both of ours get ``--trainer.limit_val_batches=0`` and no completion tables. Each method
runs in a fresh process; the methods alternate, the order rotating by one each repetition.
Recorded per run: seconds per step (the gap between consecutive optimizer steps, median
after the first), peak memory three ways (the trainer process's peak RSS, exact, from the
kernel; sampled once a second, the process tree's PSS, trainer plus reward workers with shared pages split between
sharers, the fair total since TRL scores rewards in its trainer process and we score them in
worker processes; and the tree's summed RSS, which counts shared pages in every process),
and the reward per step. Samples differ between the libraries (each
draws its own random numbers), so the rewards are comparable as curves, not step by step.

Targets (issue 26): LoGRA's seconds per step <= 0.70 x TRL's, its peak RSS <= 0.40 x TRL's
(judged on the trainer's RSS and on the tree's PSS, each reported).

    python -m benchmarks.peers                  # about 15 minutes on 2 CPU cores, alone
    python -m benchmarks.peers --steps 6 --repetitions 2
    python -m benchmarks.peers --render benchmarks/results/peers.json

Run logs and MLflow stores stay in ``lightning_logs/peers``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from .cli_runs import fresh_work, mlflow_environment, timed_metric_history
from .harness import (ROOT, argument_parser, code_version, command_line, cpu_caption, load_json, machine_info, machine_line,
                      pyplot, save_figure, save_json, write_outputs)

METHODS = ("trl", "dense", "logra")
CONFIGS = {"dense": "configs/quickstart_dense.yaml", "logra": "configs/quickstart.yaml"}
STEPS = 6
REPETITIONS = 2
TARGETS = {"seconds_per_step": 0.70, "peak_rss": 0.40}  # LoGRA / TRL
LEARNING_RATE = 1e-5
MIB = 2**20
# The peak memory figures of each run (TreePeak); the peak RSS target applies to each.
PEAKS = {"peak_main_mib": "peak RSS of the trainer process",
         "peak_tree_pss_mib": "peak PSS of the process tree (trainer + reward workers, shared pages split)",
         "peak_tree_rss_mib": "peak summed RSS of the process tree (shared pages counted in each process)"}


def quickstart_prompts(steps: int) -> list[dict]:
    """The prompts (rendered text and answer) of the quickstart's first ``steps`` training
    batches, in the order ``logra fit`` draws them."""
    from lightning_logra.data import PromptDataModule

    settings = yaml.safe_load((ROOT / CONFIGS["logra"]).read_text())["data"]["init_args"]
    data = PromptDataModule(**settings)
    data.setup("fit")
    rows = []
    for _, batch in zip(range(steps), data.train_dataloader()):
        rows += [{"prompt": text, "answer": answer} for text, answer in zip(batch["prompt_text"], batch["answer"])]
    return rows


def trl_worker(steps: int, output: Path) -> None:
    """One TRL run (in its own process): the step times and rewards go to ``output``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_logra.models import load_tokenizer, model_source
    from lightning_logra.rewards.math import math_reward

    source = model_source("smollm2-135m-instruct")
    stamps: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(output.parent / "trl_output"), use_cpu=True, bf16=False, seed=0, max_steps=steps,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        per_device_train_batch_size=16, gradient_accumulation_steps=2, num_generations=8, max_completion_length=16,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(source, dtype="float32"), args=config,
                          reward_funcs=[math_reward], train_dataset=Dataset.from_list(quickstart_prompts(steps)),
                          processing_class=load_tokenizer(source), callbacks=[StepClock()])
    started = time.perf_counter()
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    output.write_text(json.dumps({"step_seconds": [b - a for a, b in zip([started, *stamps], stamps)],
                                  "rewards": rewards, "settings": config.to_dict()}, default=str))


class TreePeak:
    """Peaks of a process tree, sampled once a second (reading a large process's
    ``smaps_rollup`` costs CPU: at 5 Hz it slowed every method's steps by 15-25%): the
    tree's summed RSS (``tree_rss``: pages shared between processes, such as a forkserver's
    with its children, counted in each) and summed PSS (``tree_pss``: each shared page split
    between its sharers, so nothing counts twice). The trainer's own peak RSS is exact, from
    the kernel at exit (``wait4``)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process, self._done = psutil.Process(pid), threading.Event()
        self.peaks = {"tree_rss": 0, "tree_pss": 0}
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._done.is_set():
            try:
                members = [self.process, *self.process.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            for member in members:
                try:
                    rss += member.memory_info().rss
                    pss += _pss_bytes(member.pid)
                except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                    pass
            self.peaks["tree_rss"] = max(self.peaks["tree_rss"], rss)
            self.peaks["tree_pss"] = max(self.peaks["tree_pss"], pss)
            self._done.wait(1.0)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self._thread.join()
        return self.peaks


def _pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def run_method(method: str, steps: int, work: Path, repetition: int) -> dict:
    name = f"{method}-rep{repetition}"
    environment = mlflow_environment(work)
    if method == "trl":
        output = work / f"{name}.json"
        command = [sys.executable, "-m", "benchmarks.peers", "--trl-worker", str(steps), str(output)]
    else:
        command = [sys.executable, "-c", "from lightning_logra.cli import main; main()", "fit", "-c", CONFIGS[method],
                   f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
                   "--model.init_args.logging.completions_every=0", f"--trainer.default_root_dir={work}",
                   "--trainer.logger.init_args.experiment_name=peers", f"--trainer.logger.init_args.run_name={name}"]
    print(f"{name}: {steps} steps", flush=True)
    started = time.perf_counter()
    with (work / f"{name}.log").open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
        sampler = TreePeak(process.pid)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = code = os.waitstatus_to_exitcode(status)
        peaks = {"main": usage.ru_maxrss * 1024, **sampler.stop()}  # ru_maxrss: KiB on Linux
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}); see {work / f'{name}.log'}")
    if method == "trl":
        record = json.loads(output.read_text())
        step_seconds, rewards, settings = record["step_seconds"], record["rewards"], record["settings"]
    else:
        history = timed_metric_history(work / "mlflow.db", name, "reward/mean")
        stamps = [stamp for _, _, stamp in history]
        step_seconds = [b - a for a, b in zip(stamps, stamps[1:])]  # the first step's own time is not logged
        rewards, settings = [value for _, value, _ in history], {"config": CONFIGS[method]}
    result = {"method": method, "repetition": repetition, "seconds": seconds,
              **{f"peak_{kind}_mib": value / MIB for kind, value in peaks.items()},
              "step_seconds": step_seconds, "rewards": rewards, "settings": settings}
    print(f"  {median_step(result):.1f} s/step, peak RSS {peaks['main'] / 2**30:.2f} GiB (tree: RSS "
          f"{peaks['tree_rss'] / 2**30:.2f}, PSS {peaks['tree_pss'] / 2**30:.2f}), rewards "
          f"{' '.join(f'{r:.2f}' for r in rewards)}", flush=True)
    return result


def median_step(run: dict) -> float:
    """The median step, the first left out (TRL's includes its warm-up; ours is not logged)."""
    times = run["step_seconds"][1:] if run["method"] == "trl" else run["step_seconds"]
    return statistics.median(times)


def summarise(runs: list[dict]) -> dict:
    per_method = {}
    for method in METHODS:
        mine = [run for run in runs if run["method"] == method]
        per_method[method] = {"seconds_per_step": statistics.median(median_step(run) for run in mine),
                              **{key: statistics.median(run[key] for run in mine) for key in PEAKS},
                              "mean_reward": statistics.mean(r for run in mine for r in run["rewards"])}
    trl, logra = per_method["trl"], per_method["logra"]
    ratios = {"seconds_per_step": logra["seconds_per_step"] / trl["seconds_per_step"],
              **{key: logra[key] / trl[key] for key in PEAKS}}
    # Paired per repetition: each repetition ran every method once, back to back.
    by_run = {(run["method"], run["repetition"]): run for run in runs}
    paired_ratios = [median_step(by_run["logra", repetition]) / median_step(by_run["trl", repetition])
                     for repetition in sorted({run["repetition"] for run in runs})]
    return {"per_method": per_method, "logra_over_trl": ratios, "paired_seconds_ratios": paired_ratios,
            "met": {key: ratios[key] <= TARGETS["seconds_per_step" if key == "seconds_per_step" else "peak_rss"]
                    for key in ratios}}


def render(result: dict) -> str:
    summary = result["summary"]
    lines = ["# The peer: TRL's GRPOTrainer vs ours on the quickstart (SmolLM2-135M-Instruct, CPU)", "",
             "| method | s/step (median of repetitions' medians) | peak RSS, trainer (GiB) | peak PSS, tree (GiB) | "
             "peak RSS summed, tree (GiB) | mean reward |", "|---|---:|---:|---:|---:|---:|"]
    for method, entry in summary["per_method"].items():
        lines.append(f"| {method} | {entry['seconds_per_step']:.1f} | "
                     + " | ".join(f"{entry[key] / 1024:.2f}" for key in PEAKS) + f" | {entry['mean_reward']:.3f} |")
    ratios, met = summary["logra_over_trl"], summary["met"]
    lines += ["", f"LoGRA / TRL seconds per step: {ratios['seconds_per_step']:.2f} (target <= "
                  f"{TARGETS['seconds_per_step']}: {'met' if met['seconds_per_step'] else 'missed'}; per "
                  f"repetition {', '.join(f'{r:.2f}' for r in summary['paired_seconds_ratios'])})."]
    lines += [f"LoGRA / TRL {label}: {ratios[key]:.2f} (target <= {TARGETS['peak_rss']}: "
              f"{'met' if met[key] else 'missed'})." for key, label in PEAKS.items()]
    lines += ["", "| run | s/step, each step | peak RSS trainer / PSS tree / RSS tree (GiB) | reward per step | run s |",
              "|---|---|---|---|---:|"]
    for run in result["runs"]:
        lines.append(f"| {run['method']} rep {run['repetition']} | {' '.join(f'{s:.1f}' for s in run['step_seconds'])} | "
                     + " / ".join(f"{run[key] / 1024:.2f}" for key in PEAKS)
                     + f" | {' '.join(f'{r:.2f}' for r in run['rewards'])} | {run['seconds']:.0f} |")
    lines += ["", f"{machine_line(result['machine'])}; {result['steps']} steps per run, {result['repetitions']} "
                  f"repetitions; command: `{result['command']}`."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.8))
    per_method = result["summary"]["per_method"]
    colours = {"trl": "tab:grey", "dense": "tab:blue", "logra": "tab:green"}
    names = list(per_method)
    speed.bar(names, [per_method[m]["seconds_per_step"] for m in names], color=[colours[m] for m in names])
    speed.set(ylabel="seconds per optimizer step (median)")
    width = 0.38
    for offset, key, hatch in ((-width / 2, "peak_main_mib", None), (width / 2, "peak_tree_pss_mib", "//")):
        memory.bar([i + offset for i in range(len(names))], [per_method[m][key] / 1024 for m in names], width=width,
                   color=[colours[m] for m in names], hatch=hatch,
                   label="trainer process, RSS" if hatch is None else "process tree, PSS")
    memory.set_xticks(range(len(names)), names)
    memory.set(ylabel="peak memory (GiB)")
    save_figure(figure, path, f"GRPO on the quickstart, 4 x 8 samples x 16 tokens - {cpu_caption(result['machine'])}, "
                              f"{result['command']}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-worker":
        trl_worker(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    args: argparse.Namespace = parser.parse_args()
    stem = args.out / "peers"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    work = fresh_work("peers")
    runs = []
    for repetition in range(args.repetitions):
        order = METHODS[repetition % len(METHODS):] + METHODS[:repetition % len(METHODS)]
        runs += [run_method(method, args.steps, work, repetition) for method in order]
    result = {"runs": runs, "summary": summarise(runs), "steps": args.steps, "repetitions": args.repetitions,
              "command": command_line("peers"), "machine": machine_info(), "code": code_version(),
              "settings": {"learning_rate": LEARNING_RATE, "prompts_per_step": 4, "generations": 8, "max_new_tokens": 16,
                           "temperature": 1.0, "kl": 0.0}}
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
