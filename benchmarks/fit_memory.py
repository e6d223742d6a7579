"""Per-rank host memory of a whole ``logra fit``, run as a user runs it, on 1, 2 and 4 gloo
processes: the peak RSS of every rank over the whole run, sampled every 0.5 s.

A random Llama-architecture model of 0.43B parameters (``FIT_MODEL``: tied embeddings,
1.6 GiB in float32) is written once as sharded safetensors with a byte-level tokenizer.
Each run is ``logra fit`` of one GRPO step under ``logra_fsdp`` (LoGRA rank 64, the arithmetic
task, 2 prompts x 2 samples of 16 new tokens per rank, no validation, MLflow and
checkpointing off), with no KL reference or a bfloat16 one (``bf16-mixed``), under one of
``ALLOCATORS``: the library's tuning as it is (``library``: ``lightning_logra.allocator``, on by
default), glibc's defaults (``glibc``: ``LIGHTNING_LOGRA_MALLOC_TUNING=0``), or glibc's
settings fixed by hand (two arenas; mmap thresholds from 64 KiB to 4 MiB). A rank is a
process whose command is the ``logra`` entry point (the reward functions' worker processes
are left out).

Target (issue 43): with the defaults, each rank's peak at most 0.8x the 1-process peak on 2
processes and at most 0.6x on 4, with and without the reference.

``--step-time`` measures what each allocator setting costs in time instead (nothing else
may run): the quickstart (``configs/quickstart.yaml``, 4 steps, no validation) under each of
``--allocators`` in turn, ``--repeats`` rounds; seconds per step are the median gap between
the MLflow timestamps of steps 2 to 4 (the first step warms up). Run by hand::

    python -m benchmarks.fit_memory --allocators library glibc     # every world and reference
    python -m benchmarks.fit_memory --worlds 1 2 --references none --allocators mmap64k mmap1m
    python -m benchmarks.fit_memory --step-time --allocators library glibc mmap64k \
        --render benchmarks/results/fit_memory.json                # adds to it
    python -m benchmarks.fit_memory --accounts --references none    # what each rank holds, per phase
    python -m benchmarks.fit_memory --smoke --out /tmp/fm
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .harness.records import (argument_parser, check_smoke_out, code_version, command_line, load_json, machine_info,
                              save_json, write_outputs)

GIB = 2**30
FIT_MODEL = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 26,
             "num_attention_heads": 16, "num_key_value_heads": 4, "tie_word_embeddings": True}
SMOKE_MODEL = {**FIT_MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
TARGETS = {2: 0.8, 4: 0.6}
# Phase marks (benchmarks.fit_phases.PhaseMarkingGRPOModule writes them). In the order a
# 1-step fit meets them: start-up (imports, the data, building the empty models), loading
# (the strategy shards the policy and fills each rank's rows from the safetensors files),
# generation, scoring and reference (rewards, the KL reference's log-probs), forward and
# backward, the LoGRA update (the strategy's runtime.step: probe and apply), after the step
# (logging, teardown).
MARKS_VARIABLE = "FIT_MEMORY_PHASES"
ACCOUNTS_VARIABLE = "FIT_MEMORY_ACCOUNTS"  # fit_phases' allocator accounts (see there)
PHASES = ("start-up", "loading", "generation", "scoring and reference", "forward and backward", "LoGRA update",
          "after the step")
# Allocator settings a run can use, as the environment it starts with. "library" is whatever
# lightning_logra.allocator does by default; the others fix glibc's settings by hand.
TUNING_OFF = {"LIGHTNING_LOGRA_MALLOC_TUNING": "0"}
ALLOCATORS = {
    "library": {},
    "glibc": TUNING_OFF,
    "arena2": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2"},
    "mmap64k": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"},
    "mmap1m": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1048576"},
    "mmap2m": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "2097152"},
    "mmap4m": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "4194304"},
    # The 4 MiB tuning with glibc's small-block caches off (allocator.py): the per-thread
    # cache, the fast bins, both (the library's tuning since issue 43's accounts).
    "mmap4m_tcache0": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "4194304",
                       "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"},
    "mmap4m_mxfast0": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "4194304",
                       "GLIBC_TUNABLES": "glibc.malloc.mxfast=0"},
    "mmap4m_nocache": {**TUNING_OFF, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "4194304",
                       "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"},
}
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "LIGHTNING_LOGRA_MALLOC_TUNING", "GLIBC_TUNABLES")


def allocator_environment(environment: dict, allocator: str) -> dict:
    """``environment`` with this shell's allocator settings replaced by ``allocator``'s."""
    clean = {k: v for k, v in environment.items() if k not in ALLOCATOR_VARIABLES}
    return {**clean, **ALLOCATORS[allocator]}
SAMPLE_S = 0.5
MIN_RANK_SAMPLES = 10  # 5 s: every rank lives through its whole run, minutes


def write_model(folder: Path, shape: dict) -> int:
    """The random model and a byte-level tokenizer in ``folder``; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .loading import write_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(folder, max_shard_size="300MB")  # several files and an index, as the hub's
    write_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def config_text(folder: Path, work: Path, reference: str) -> str:
    precision = "bf16-mixed" if reference == "bf16" else "32-true"
    return f"""seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 1
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  precision: {precision}
  default_root_dir: {work}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra:
        rank: 64
  callbacks:
    - class_path: lightning_logra.LoGRACallback
model:
  class_path: benchmarks.fit_phases.PhaseMarkingGRPOModule
  init_args:
    model: {folder}
    loss:
      kl_coef: {0.1 if reference == "bf16" else 0.0}
    rollout:
      num_generations: 2
      max_new_tokens: 16
    reward:
      functions: [lightning_logra.rewards.math:math_reward]
data:
  class_path: lightning_logra.data.PromptDataModule
  init_args:
    train: arithmetic:1
    tokenizer: {folder}
    batch_size: 2
    train_size: 16
"""


def is_rank_command(arguments: list[str]) -> bool:
    """``python -m lightning_logra.cli ...`` (how the ranks run), not a helper whose command
    merely mentions the module (multiprocessing's forkserver names it as the main module)."""
    return any(a == "-m" and b == "lightning_logra.cli" for a, b in zip(arguments, arguments[1:]))


def rank_processes(root) -> list:
    """``root`` and its descendants that run the ``logra`` entry point (the ranks)."""
    import psutil

    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            if is_rank_command(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def measure(folder: Path, world: int, reference: str, allocator: str = "library", accounts: bool = False) -> dict:
    """One ``logra fit`` on ``world`` processes; each rank's peak RSS and the timeline, and
    with ``accounts`` each rank's split of its memory per phase (``phase_accounts``)."""
    import psutil

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "config.yaml").write_text(config_text(folder, work, reference))
        environment = allocator_environment({**os.environ, "OMP_NUM_THREADS": "1"}, allocator)
        environment[MARKS_VARIABLE] = str(work / "phases.txt")
        if accounts:
            environment[ACCOUNTS_VARIABLE] = str(work / "accounts")
        started, started_wall = time.perf_counter(), time.time()
        process = subprocess.Popen([sys.executable, "-m", "lightning_logra.cli", "fit",
                                    "-c", str(work / "config.yaml"), f"--trainer.devices={world}"],
                                   env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        root, peaks, timeline, done = psutil.Process(process.pid), {}, [], threading.Event()

        def sample() -> None:
            while not done.is_set():
                now = time.perf_counter() - started
                for rank in rank_processes(root):
                    try:
                        rss = rank.memory_info().rss
                    except psutil.Error:
                        continue
                    peaks[rank.pid] = max(peaks.get(rank.pid, 0), rss)
                    timeline.append((round(now, 1), rank.pid, rss))
                done.wait(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        output, _ = process.communicate()
        done.set()
        sampler.join()
        marks = read_marks(work / "phases.txt") if (work / "phases.txt").exists() else {}
        split = phase_accounts(work / "accounts", world, marks) if accounts else None
    if process.returncode != 0:
        raise SystemExit(f"logra fit on {world} processes failed (exit {process.returncode}):\n{output[-3000:]}")
    # A rank's fork (a worker or a subprocess before its exec) carries the rank's command
    # for a moment: a rank is a process seen through MIN_RANK_SAMPLES samples.
    seen = {pid: sum(1 for _, sampled, _ in timeline if sampled == pid) for pid in peaks}
    peaks = {pid: peak for pid, peak in peaks.items() if seen[pid] >= MIN_RANK_SAMPLES}
    timeline = [sample for sample in timeline if sample[1] in peaks]
    if len(peaks) != world:
        raise SystemExit(f"found {len(peaks)} rank processes for {world} ranks")
    order = sorted(peaks, key=lambda pid: (pid != process.pid, pid))  # the launcher (rank 0) first
    ranked = [(started_wall + t, order.index(pid), rss / GIB) for t, pid, rss in timeline]
    return {"world": world, "reference": reference, "allocator": allocator, "seconds": time.perf_counter() - started,
            "rank_peak_gib": [peaks[pid] / GIB for pid in order],
            # samples kept to 0.1 MiB: a smaller JSON
            "timeline": [(t, order.index(pid), round(rss / GIB, 4)) for t, pid, rss in timeline],
            "phase_peak_gib": phase_peaks(ranked, marks), **({"phase_accounts": split} if accounts else {})}


def read_marks(path: Path) -> dict[int, list[tuple[float, str]]]:
    """Each rank's marks, in time order."""
    marks: dict[int, list[tuple[float, str]]] = {}
    for line in path.read_text().splitlines():
        moment, rank, phase = line.split(" ", 2)
        marks.setdefault(int(rank), []).append((float(moment), phase))
    return {rank: sorted(entries) for rank, entries in marks.items()}


def phase_at(marks: list[tuple[float, str]], moment: float) -> str:
    """The phase a rank was in at wall time ``moment``: its latest mark before it, else start-up."""
    current = PHASES[0]
    for marked, phase in marks:
        if marked > moment:
            break
        current = phase
    return current


def phase_peaks(timeline: list[tuple[float, int, float]], marks: dict[int, list[tuple[float, str]]]) -> dict[str, list]:
    """Per phase, each rank's peak RSS (GiB, None where a rank had no sample in it) from
    ``timeline`` entries ``(wall time, rank, rss GiB)``."""
    ranks = sorted({rank for _, rank, _ in timeline})
    peaks = {phase: [None] * len(ranks) for phase in PHASES}
    for moment, rank, rss in timeline:
        phase = phase_at(marks.get(rank, []), moment)
        current = peaks[phase][rank]
        peaks[phase][rank] = rss if current is None else max(current, rss)
    return peaks


def phase_accounts(prefix: Path, world: int, marks: dict[int, list[tuple[float, str]]]) -> dict[str, list]:
    """Per phase, each rank's memory split at its peak-RSS sample in that phase (GiB: RSS, in
    use in glibc's arenas, kept free in them, mmapped blocks, and the rest: Python's own
    arenas, code and libraries) and the live CPU tensors at the phase's end (the census)."""
    split = {phase: [None] * world for phase in PHASES}
    for rank in range(world):
        path = Path(f"{prefix}.{rank}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            moment, kind, *fields = line.split(" ")
            if kind == "sample":
                rss, in_use, free, mapped = (int(f) / GIB for f in fields)
                phase = phase_at(marks.get(rank, []), float(moment))
                entry = split[phase][rank] or {"rss": 0.0}
                if rss >= entry["rss"]:
                    entry = {**entry, "rss": rss, "arena_in_use": in_use, "arena_free": free, "mmapped": mapped,
                             "rest": rss - in_use - free - mapped}
                split[phase][rank] = entry
            else:
                phase = " ".join(fields[1:])  # the phase the census ended
                split[phase][rank] = {**(split[phase][rank] or {"rss": 0.0}), "live_tensors": int(fields[0]) / GIB}
    return split


def step_seconds(allocator: str, steps: int) -> float:
    """The quickstart's median seconds per step (steps 2..``steps``) with ``allocator``'s settings."""
    from .cli_runs import fresh_work, mlflow_environment, run_logra, timed_metric_history

    work = fresh_work("fit_memory_step_time")
    environment = allocator_environment(mlflow_environment(work), allocator)
    run_logra(["fit", "-c", "configs/quickstart.yaml", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
               f"--trainer.default_root_dir={work}", "--trainer.logger.init_args.run_name=timing"], environment,
              work / "run.log")
    clock = [c for _, _, c in timed_metric_history(work / "mlflow.db", "timing", "reward/mean")]
    return statistics.median(b - a for a, b in zip(clock[1:], clock[2:]))


# What one micro-batch holds: GRPOModule's default 4 rows, each a chat-rendered arithmetic:1
# prompt of the byte tokenizer (about 60 tokens) and 16 new tokens.
MICRO_BATCH_TOKENS = 4 * (60 + 16)


def predicted_gib(shape: dict, world: int, reference: str, baseline_gib: float) -> float:
    """A rank's predicted peak: the process with its imports (``baseline_gib``, measured: the
    1-process peak of the same run on a tiny model) plus ``planning.step_memory``'s peak."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_logra import LoGRAConfig
    from lightning_logra.planning import StepSettings, step_memory

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    settings = StepSettings(method="logra", tokens=MICRO_BATCH_TOKENS, row_tokens=MICRO_BATCH_TOKENS // 4,
                            world_size=world, logra=LoGRAConfig(rank=64), reference=reference == "bf16",
                            compute_dtype=torch.bfloat16 if reference == "bf16" else torch.float32)
    return baseline_gib + step_memory(model, settings).peak / GIB


def summarise(result: dict) -> list[dict]:
    rows = []
    for run in result["runs"]:
        single = next((r for r in result["runs"] if r["world"] == 1 and r["reference"] == run["reference"]
                       and r["allocator"] == run["allocator"] and r["code"] == run["code"]), None)
        base = None if single is None else single["rank_peak_gib"][0]
        worst = max(run["rank_peak_gib"])
        target = TARGETS.get(run["world"])
        predicted = (predicted_gib(result["shape"], run["world"], run["reference"], result["baseline_gib"])
                     if run["allocator"] != "glibc" and result.get("baseline_gib") else None)
        rows.append({**{k: run[k] for k in ("world", "reference", "allocator", "code", "seconds", "rank_peak_gib")},
                     "ratio": None if base is None else worst / base, "target": target,
                     "met": None if base is None or target is None else worst / base <= target,
                     "predicted_gib": predicted,
                     "prediction_error": None if predicted is None else max(abs(p / predicted - 1)
                                                                            for p in run["rank_peak_gib"])})
    return rows


ALLOCATOR_LABELS = {"library": "the library's tuning (default)", "glibc": "glibc's defaults",
                    "trim": "2 arenas, malloc_trim between phases",
                    "mmap4m_trim": "2 arenas, mmap >= 4 MiB, malloc_trim between phases",
                    "arena2": "2 arenas", "mmap64k": "2 arenas, mmap >= 64 KiB", "mmap1m": "2 arenas, mmap >= 1 MiB",
                    "mmap2m": "2 arenas, mmap >= 2 MiB", "mmap4m": "2 arenas, mmap >= 4 MiB",
                    "mmap4m_tcache0": "2 arenas, mmap >= 4 MiB, no tcache",
                    "mmap4m_mxfast0": "2 arenas, mmap >= 4 MiB, no fast bins",
                    "mmap4m_nocache": "2 arenas, mmap >= 4 MiB, no tcache or fast bins"}


def allocator_label(name: str) -> str:
    return ALLOCATOR_LABELS.get(name, name)


def render(result: dict) -> str:
    lines = [("Smoke run on a tiny model: measures nothing.\n\n" if result["smoke"] else "")
             + f"`logra fit`, one GRPO step under logra_fsdp, rank 64, on gloo CPU processes; model "
             f"{result['parameters'] / 1e9:.2f}B parameters ({result['parameters'] * 4 / GIB:.2f} GiB in float32). "
             "Peak RSS of each rank over the whole run (sampled every 0.5 s), and the largest rank's peak over the "
             "1-process peak of the same configuration and code.", "",
             f"Predicted: the process with its imports ({result.get('baseline_gib') or 0:.2f} GiB, the peak of the same "
             "1-process run on a tiny model) plus `planning.step_memory`'s step peak; target: within 15% of every "
             "rank's measured peak.", "",
             "| processes | KL reference | allocator | code | rank peaks (GiB) | largest / 1 process | target "
             "| predicted (GiB) | largest error | seconds |",
             "|---:|---|---|---|---|---:|---|---:|---|---:|"]
    for row in summarise(result):
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        target = "" if row["target"] is None else f"<= {row['target']}: " + ("met" if row["met"] else "missed")
        predicted = "" if row["predicted_gib"] is None else f"{row['predicted_gib']:.2f}"
        error = "" if row["prediction_error"] is None else (
            f"{100 * row['prediction_error']:.0f}% ({'met' if row['prediction_error'] <= 0.15 else 'missed'})")
        lines.append(f"| {row['world']} | {row['reference']} | {allocator_label(row['allocator'])} | "
                     f"{str(row['code'].get('git_commit'))[:7]} | {', '.join(f'{p:.2f}' for p in row['rank_peak_gib'])} "
                     f"| {ratio} | {target} | {predicted} | {error} | {row['seconds']:.0f} |")
    phased = [run for run in result["runs"] if run.get("phase_peak_gib")]
    if phased:
        lines += ["", "Per phase (`benchmarks/fit_phases.py` marks where each begins): the largest rank's peak RSS in "
                      "GiB while in it.", "",
                  "| processes | KL reference | allocator | " + " | ".join(PHASES) + " |",
                  "|---:|---|---|" + "---:|" * len(PHASES)]
        for run in phased:
            cells = [max((p for p in run["phase_peak_gib"][phase] if p is not None), default=None) for phase in PHASES]
            lines.append(f"| {run['world']} | {run['reference']} | {allocator_label(run['allocator'])} | "
                         + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    accounted = [run for run in result["runs"] if run.get("phase_accounts")]
    if accounted:
        lines += ["", "What the largest rank holds, per phase (`FIT_MEMORY_ACCOUNTS`: its RSS and glibc's counters sampled "
                      "every 0.1 s, split at the phase's peak RSS; live tensors counted at the phase's end), GiB. glibc's "
                      "bytes in use are in its arenas (blocks under the mmap threshold) or mmapped; 'kept free' is "
                      "freed memory glibc holds in its arenas; the rest is Python's own arenas, code and libraries.", "",
                  "| processes | KL reference | allocator | code | phase | RSS | live tensors | in use: arenas | in use: "
                  "mmapped | kept free | rest |", "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for run in accounted:
            largest = max(range(run["world"]), key=lambda rank: run["rank_peak_gib"][rank])
            for phase in PHASES[1:]:  # the sampler starts when loading does
                entry = run["phase_accounts"][phase][largest]
                if entry is None or "arena_in_use" not in entry:
                    continue
                live = "" if "live_tensors" not in entry else f"{entry['live_tensors']:.2f}"
                lines.append(f"| {run['world']} | {run['reference']} | {allocator_label(run['allocator'])} | "
                             f"{str(run['code'].get('git_commit'))[:7]} | {phase} | {entry['rss']:.2f} | {live} | "
                             f"{entry['arena_in_use']:.2f} | {entry['mmapped']:.2f} | {entry['arena_free']:.2f} | "
                             f"{entry['rest']:.2f} |")
    for timing in result.get("step_time", []):
        medians = {name: statistics.median(times) for name, times in timing["seconds"].items()}
        glibc = medians.get("glibc")
        lines += ["", f"Step time, the quickstart alone on this machine ({timing['note'] + '; ' if timing.get('note') else ''}"
                      f"`{timing['command']}`, code {str(timing['code'].get('git_commit'))[:7]}"
                      f"{' + local edits' if timing['code'].get('lightning_logra_locally_modified') else ''}), "
                      "median seconds per step (each run's):", "",
                  "| allocator | s per step | runs | against glibc's defaults |", "|---|---:|---|---:|"]
        for name, median in medians.items():
            against = "" if glibc is None or name == "glibc" else f"{100 * (median / glibc - 1):+.1f}%"
            lines.append(f"| {allocator_label(name)} | {median:.2f} | "
                         f"{', '.join(f'{t:.2f}' for t in timing['seconds'][name])} | {against} |")
    study = result.get("allocator_study")
    if study:
        lines += ["", f"Allocator settings explored ({study['note']}): peak RSS in GiB.", "",
                  "| allocator | 1 process | 2 processes, per rank | largest / 1 process |", "|---|---:|---|---:|"]
        for name, peaks in study["rank_peak_gib"].items():
            lines.append(f"| {allocator_label(name)} | {peaks['1'][0]:.2f} | {', '.join(f'{p:.2f}' for p in peaks['2'])} "
                         f"| {max(peaks['2']) / peaks['1'][0]:.2f} |")
    lines += ["", "Commands: " + "; ".join(sorted({f"`{run_command}`" for run_command in
                                                 [result["command"], *result.get("commands", [])]})) + "."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from .harness import pyplot, save_figure

    plt = pyplot()
    runs = result["runs"]
    columns = len({run["world"] for run in runs})  # one row per (reference, allocator), one column per world size
    rows = -(-len(runs) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.8 * rows), squeeze=False, sharey=True)
    ordered = sorted(runs, key=lambda run: (run["reference"], run["allocator"], run["world"]))
    for axis, run in zip(axes.flat, ordered):
        for rank in range(run["world"]):
            points = [(t, rss) for t, r, rss in run["timeline"] if r == rank]
            axis.plot([t for t, _ in points], [rss for _, rss in points], label=f"rank {rank}")
        axis.set_title(f"{run['world']} proc, ref {run['reference']}, "
                       f"{run['allocator']} @{str(run['code'].get('git_commit'))[:7]}", fontsize=8)
        axis.set_xlabel("seconds")
    for row in axes:
        row[0].set_ylabel("RSS (GiB)")
    axes[-1][-1].legend(fontsize=7)
    save_figure(figure, path, "Per-rank RSS over a whole 1-step logra fit")


def timed_allocators(names: list[str], repeats: int) -> dict:
    """Seconds per quickstart step under each allocator setting, in turn, ``repeats`` rounds."""
    timing = {"command": command_line("fit_memory"), "code": code_version(), "seconds": {name: [] for name in names}}
    for _ in range(repeats):
        for name in names:
            timing["seconds"][name].append(step_seconds(name, steps=4))
            print(f"{name}: {timing['seconds'][name][-1]:.2f} s per step", flush=True)
    return timing


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--references", nargs="+", choices=["none", "bf16"], default=["none", "bf16"])
    parser.add_argument("--allocators", nargs="+", choices=sorted(ALLOCATORS), default=["library"])
    parser.add_argument("--step-time", action="store_true", help="with --render: time the quickstart's step under "
                                                                     "each of --allocators, added to that result")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--add-baseline", action="store_true", help="with --render: measure the process with its "
                                                                       "imports (for the predictions) and add it")
    parser.add_argument("--accounts", action="store_true", help="split each rank's memory per phase (live tensors, "
                                                                    "glibc's arenas and mmapped blocks)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model: every code path, measuring nothing")
    args = parser.parse_args()
    if args.render:
        result = load_json(args.render)
        if args.step_time:
            result.setdefault("step_time", []).append(timed_allocators(args.allocators, args.repeats))
        if args.add_baseline:
            with tempfile.TemporaryDirectory() as scratch:
                write_model(Path(scratch) / "tiny", SMOKE_MODEL)
                result["baseline_gib"] = measure(Path(scratch) / "tiny", 1, "none")["rank_peak_gib"][0]
                result["baseline_command"] = command_line("fit_memory")
        if args.step_time or args.add_baseline:
            save_json(args.render, result)
        write_outputs(args.out / "fit_memory", result, render, plot)
        return
    check_smoke_out(parser, args)
    path = args.out / "fit_memory.json"
    result = load_json(path) if path.exists() else None  # new runs are added to the runs already there
    if result is not None and result["smoke"] != args.smoke:
        parser.error(f"{path} holds {'smoke' if result['smoke'] else 'measured'} runs; --out elsewhere")
    command, code = command_line("fit_memory"), code_version()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        parameters = write_model(folder, SMOKE_MODEL if args.smoke else FIT_MODEL)
        write_model(Path(scratch) / "tiny", SMOKE_MODEL)
        baseline = measure(Path(scratch) / "tiny", 1, "none")["rank_peak_gib"][0]
        print(f"the process with its imports (a tiny model, 1 process): {baseline:.2f} GiB", flush=True)
        if result is None:
            result = {"smoke": args.smoke, "command": command, "machine": machine_info(), "code": code,
                      "shape": SMOKE_MODEL if args.smoke else FIT_MODEL, "parameters": parameters, "runs": []}
        else:
            result.setdefault("commands", []).append(command)
        result["baseline_gib"] = baseline
        for reference in args.references:
            for world in sorted(set(args.worlds) | {1}):
                for allocator in args.allocators:
                    run = measure(folder, world, reference, allocator, args.accounts)
                    result["runs"].append({**run, "code": code, "command": command})
                    save_json(path, result)  # each run kept as it ends: a later failure loses none
                    print(f"{world} processes, reference {reference}, {allocator}: "
                          f"rank peaks {', '.join(f'{p:.2f}' for p in run['rank_peak_gib'])} GiB", flush=True)
    write_outputs(args.out / "fit_memory", result, render, plot)

if __name__ == "__main__":
    main()
