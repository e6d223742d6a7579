"""The modes side by side: one warm-up step each, then repetitions in a rotating order, with
the load of other processes read around every step; medians, ratios and paired ratios."""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

from .step import Replay, Runner

QUIET_CORES = 0.25  # a repetition is quiet when other processes used fewer cores than this in every step


# --- the modes side by side -------------------------------------------------------------------

def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (all processes), or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def timed_step(runner: Runner, replay: Replay) -> tuple[dict[str, float], dict]:
    """One step, and how many cores other processes used meanwhile."""
    gc.collect()
    cpu0, busy0, wall0 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
    times = runner.step(replay)
    cpu1, busy1, wall1 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
    others = None if busy0 is None else max(busy1 - busy0 - (cpu1 - cpu0), 0.0) / (wall1 - wall0)
    return times, {"other_processes_cores": others, "load_average_1min": os.getloadavg()[0]}


def alternate_modes(runners: dict[str, Runner], replay: Replay, reps: int, label: str | None = None) -> dict:
    """Every runner's step ``reps`` times on the same replayed rollouts: an untimed warm-up
    (the first micro-batch and an update) per mode, then repetitions whose mode order
    rotates by one. Returns ``samples`` and ``contention`` (mode -> one entry per repetition)."""
    modes = tuple(runners)
    for mode in modes:  # first-call costs, not timed
        runners[mode].step(replay, rows=slice(0, runners[mode].settings.micro_batch_size))
    samples = {mode: [] for mode in modes}
    contention = {mode: [] for mode in modes}
    for rep in range(reps):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            times, load = timed_step(runners[mode], replay)
            samples[mode].append(times)
            contention[mode].append(load)
            if label:
                print(f"[{label}] rep {rep + 1}/{reps} {mode}: {times['step']:.1f} s", flush=True)
    return {"samples": samples, "contention": contention}


def summarise(samples: dict[str, list[dict]], contention: dict[str, list[dict]] | None = None) -> dict:
    """Every sample, the per-piece medians, LoGRA's ratios to dense and LoRA from them (with
    and without the probe), the probe's share of LoGRA's step, the paired per-repetition
    LoGRA / dense ratios and, with ``contention``, the ratio over quiet repetitions."""
    medians = {mode: {piece: statistics.median(s[piece] for s in runs) for piece in runs[0]} for mode, runs in samples.items()}
    out: dict[str, Any] = {"samples": samples, "medians_s": medians}
    logra = medians.get("logra")
    if logra is None:
        return out
    without_probe = logra["step"] - logra["kl_probe"]
    for base in ("dense", "lora"):
        if base in medians:
            out[f"logra_over_{base}"] = logra["step"] / medians[base]["step"]
            out[f"logra_over_{base}_without_probe"] = without_probe / medians[base]["step"]
    out["probe_share_of_logra_step"] = logra["kl_probe"] / logra["step"]
    if "dense" in samples:
        paired = [l["step"] / d["step"] for l, d in zip(samples["logra"], samples["dense"])]
        out["paired_logra_over_dense"] = paired
        out["median_paired_logra_over_dense"] = statistics.median(paired)
    if contention:
        out["contention"] = contention
        reps = len(samples["logra"])
        quiet = [rep for rep in range(reps) if all(
            loads[rep]["other_processes_cores"] is not None and loads[rep]["other_processes_cores"] < QUIET_CORES
            for loads in contention.values())]
        out["quiet_repetitions"] = quiet
        if len(quiet) >= 2 and "dense" in samples:
            out["quiet_logra_over_dense"] = (statistics.median(samples["logra"][rep]["step"] for rep in quiet)
                                             / statistics.median(samples["dense"][rep]["step"] for rep in quiet))
    return out


def contention_line(row: dict) -> str | None:
    """The paired ratios and other processes' load of a summarised row, None for rows
    measured before the harness recorded them."""
    if "contention" not in row:
        return None
    reps = len(row["paired_logra_over_dense"])
    loads = [max(loads[rep]["other_processes_cores"] or 0.0 for loads in row["contention"].values()) for rep in range(reps)]
    quiet = row.get("quiet_logra_over_dense")
    return (f"paired LoGRA / dense per repetition {', '.join(f'{r:.3f}' for r in row['paired_logra_over_dense'])} "
            f"(median {row['median_paired_logra_over_dense']:.3f}); other processes' cores per repetition (the most "
            f"during any mode's step) {', '.join(f'{x:.2f}' for x in loads)}; LoGRA / dense over the quiet repetitions "
            f"(< {QUIET_CORES} cores): " + (f"{quiet:.3f} ({len(row['quiet_repetitions'])})" if quiet is not None
                                             else f"n/a ({len(row['quiet_repetitions'])} quiet)"))
