"""What occupies memory, phase by phase, in one RL step of each mode (the memory benchmark's setting).

The step of ``memory.py`` (GRPOModule's step replayed by ``harness.Runner.step``: 156M
Qwen2, float32, 2 rows of 2,048 tokens one per micro-batch, activation checkpointing, the
probe on both rows), run once under ``torch.profiler`` with ``profile_memory=True``. Every
tensor allocation and free is an event of the CPU allocator, with the op that made it and
the profiler range it happened in, so the ledger is measured, not estimated:

- phases, from the profiler ranges: the update function's around the forward/backward
  (``rl.forward_backward``; the forward of micro-batch i is what runs in it before its
  backward), the harness's around each backward (``bench.backward``), the optimizer step
  (``rl.optimizer_step``: dense AdamW's / LoRA's), and LoGRA's own ``logra.prepare``,
  ``logra.probe`` and ``logra.apply`` inside ``LoGRAOptimizer.step``;
- per phase: the bytes live at its start, at its peak and at its end;
- at each phase's peak: what is live, grouped by where it was allocated (before the step:
  weights and optimizer or LoGRA state, by inventory: ``LoGRAOptimizer.state_bytes()``,
  AdamW's state tensors; during it: phase and op).

``logra_mlp_whole`` is LoGRA with the probe's MLPs over whole rows (``probe_mlp_chunk_tokens``
as long as a row), as before MLPs ran in token chunks, to show what the chunking removes.

    python -m benchmarks.memory_ledger    # about 5 minutes on 2 cores; writes benchmarks/results/memory_ledger.{json,md}
    python -m benchmarks.memory_ledger --smoke --out /tmp/ledger   # every code path on a tiny model
    python -m benchmarks.memory_ledger --render benchmarks/results/memory_ledger.json
"""

from __future__ import annotations

import bisect
import json
import os
from collections import defaultdict

from .harness import (MODES, RANGES, argument_parser, build_mode, check_smoke_out, code_version, command_line,
                      load_json, machine_info, machine_line, micro_batching, optimizer_state_bytes, prompt_share,
                      random_replay, run_module, save_json, step_line, write_outputs)
from .model_shapes import BENCH_156M, SMOKE

MIB = 2**20
TOKENS, MICRO_BATCHES = 2048, 2
SMOKE_TOKENS = 64
TOP = 8  # groups listed per phase peak
LEDGER_MODES = (*MODES, "logra_mlp_whole")
# Profiler range -> phase. Forwards and backwards are numbered by micro-batch afterwards.
PHASES = {RANGES["forward_backward"]: "forward", RANGES["backward"]: "backward", RANGES["optimizer_step"]: "optimizer step",
          "logra.prepare": "prepare", "logra.probe": "probe", "logra.apply": "apply"}
OUTSIDE = "outside the phases"


def run_mode(mode: str, smoke: bool = False) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape, tokens = (SMOKE, SMOKE_TOKENS) if smoke else (BENCH_156M, TOKENS)
    prompt = prompt_share(tokens)
    settings = micro_batching(tokens - prompt)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    replay = random_replay(model, MICRO_BATCHES, prompt, tokens - prompt, shape["vocab_size"],
                           num_generations=MICRO_BATCHES, seed=1, settings=settings)
    whole_rows = {"probe_mlp_chunk_tokens": tokens} if mode == "logra_mlp_whole" else {}
    runner = build_mode(mode.split("_")[0], model, settings, probe_responses=MICRO_BATCHES, probe_max_tokens=tokens, **whole_rows)
    if runner.logra is None:
        # AdamW's state exists from its first step on: a warm-up step makes it pre-existing, as in
        # training; its gradients are freed as the next update starts (GRPOModule's zero_grad).
        runner.step(replay, rows=slice(0, 1))
        runner.optimizer.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        runner.step(replay)
    inventory = {"weights": sum(p.numel() * p.element_size() for p in runner.model.parameters())}
    state = optimizer_state_bytes(runner)
    if runner.logra is None:
        inventory["optimizer state"] = state["total"]
    else:
        inventory.update({f"LoGRA {part.replace('_', ' ')}": value for part, value in state.items() if part != "total"})
    return {"mode": mode, "inventory_bytes": inventory, **ledger(profiler)}


def _allocations(profiler) -> list[tuple[int, int, int, str, str]]:
    """(time ns, bytes (+ alloc, - free), ptr, phase, op) of every CPU allocator event, in
    time order. The phase is the innermost ``PHASES`` range an event happened in; forward i
    is what ran in the forward/backward range before backward i started (and after backward
    i - 1 ended)."""
    from torch._C._profiler import _EventType

    events, backward_starts = [], []
    stack = [(root, None, None) for root in profiler.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, phase, op = stack.pop()
        name = event.name
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.alloc_size, fields.ptr, phase, op or "-"))
            continue
        if name in PHASES:
            phase, op = (PHASES[name], event.start_time_ns), None
            if PHASES[name] == "backward":
                backward_starts.append(event.start_time_ns)
        elif event.typed[0] == _EventType.TorchOp and op is None:
            op = name  # the outermost op of the phase that this allocation happened under
        stack.extend((child, phase, op) for child in event.children)
    backward_starts.sort()

    def label(time_ns: int, phase: tuple[str, int] | None) -> str:
        if phase is None:
            return OUTSIDE
        name, started = phase
        if name == "backward":
            return f"backward {backward_starts.index(started)}"
        if name == "forward":
            index = bisect.bisect(backward_starts, time_ns)
            return f"forward {index}" if index < len(backward_starts) else "after the last backward"
        return name

    events = [(time_ns, size, ptr, label(time_ns, phase), op) for time_ns, size, ptr, phase, op in events]
    events.sort(key=lambda event: event[0])
    return events


def ledger(profiler) -> dict:
    """Per phase: live bytes (relative to the step's start) at start, peak and end, and what
    was live at its peak, grouped by (phase, op) of allocation."""
    events = _allocations(profiler)
    live: dict[int, tuple[int, str, str]] = {}  # ptr -> (bytes, phase, op) of what this step allocated
    freed_before = 0  # frees of tensors that existed before the step (negative bytes)
    current = 0
    phases: dict[str, dict] = {}
    order: list[str] = []
    for _, size, ptr, phase, op in events:
        if size > 0:
            live[ptr] = (size, phase, op)
        elif ptr in live:
            size = -live.pop(ptr)[0]
        else:
            freed_before += size
        current += size
        entry = phases.get(phase)
        if entry is None:
            entry = phases[phase] = {"start_bytes": current - size, "peak_bytes": current - size, "at_peak": {}}
            order.append(phase)
        if current > entry["peak_bytes"]:
            entry["peak_bytes"] = current
            groups = defaultdict(int)
            for bytes_, where, what in live.values():
                groups[f"{where}: {what}"] += bytes_
            entry["at_peak"] = dict(sorted(groups.items(), key=lambda item: -item[1])[:TOP])
            entry["freed_preexisting_bytes_at_peak"] = freed_before
        entry["end_bytes"] = current
    return {"phases": [{"phase": name, **phases[name]} for name in order]}


def render(result: dict) -> str:
    lines = ["Bytes relative to the start of the step (weights and state that existed before it are listed once, "
             "by inventory). At each phase's peak, the largest groups of what the step had allocated and not yet freed.", ""]
    for row in result["modes"]:
        inventory = ", ".join(f"{name} {value / MIB:,.0f}" for name, value in row["inventory_bytes"].items())
        lines += [f"### {row['mode']} (before the step, MiB: {inventory})", "",
                  "| phase | start MiB | peak MiB | end MiB | live at the peak (MiB, by phase: op that allocated it) |",
                  "|---|---:|---:|---:|---|"]
        for phase in row["phases"]:
            groups = "; ".join(f"{name} {value / MIB:,.1f}" for name, value in phase["at_peak"].items() if value >= MIB)
            lines.append(f"| {phase['phase']} | {phase['start_bytes'] / MIB:,.0f} | {phase['peak_bytes'] / MIB:,.0f} | "
                         f"{phase['end_bytes'] / MIB:,.0f} | {groups} |")
        lines.append("")
    lines.append(f"{machine_line(result['machine'])}; command: `{result['command']}`.")
    if result.get("smoke"):
        lines.append("**Smoke run on a tiny model: no figure here is a measurement.**")
    lines.append(f"Step: {step_line(result)}")
    return "\n".join(lines)


def main() -> None:
    parser = argument_parser(__doc__, render_help="measure nothing: rewrite the .md from a results file")
    parser.add_argument("--mode", choices=LEDGER_MODES, help="run one mode in this process and print its JSON")
    parser.add_argument("--smoke", action="store_true", help="the tiny model (model_shapes.SMOKE): checks the code paths, measures nothing")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.smoke)))
        return
    check_smoke_out(parser, args)
    stem = args.out / "memory_ledger"
    if args.render:
        result = load_json(args.render)
    else:
        environment = dict(os.environ, **({"OMP_NUM_THREADS": "1"} if args.smoke else {}))
        modes = []
        for mode in LEDGER_MODES:
            completed = run_module("memory_ledger", ["--mode", mode, *(["--smoke"] if args.smoke else [])],
                                   capture_output=True, text=True, env=environment)
            if completed.returncode != 0:
                raise SystemExit(f"mode {mode} failed:\n{completed.stderr[-3000:]}")
            modes.append(json.loads(completed.stdout.strip().splitlines()[-1]))
            print(f"{mode}: peak {max(p['peak_bytes'] for p in modes[-1]['phases']) / MIB:,.0f} MiB above the step's start", flush=True)
        tokens = SMOKE_TOKENS if args.smoke else TOKENS
        prompt = prompt_share(tokens)
        result = {"command": command_line("memory_ledger"), "machine": machine_info(), "code": code_version(),
                  "smoke": args.smoke,
                  "step": (f"GRPOModule's step on replayed rollouts ({MICRO_BATCHES} rows of {prompt} prompt + "
                           f"{tokens - prompt} completion tokens, one prompt): `rl.step.run_update`: `backward_micro_batches`, one row per "
                           "micro-batch, loss `grpo`, then `AdamW.step()` or `LoGRAOptimizer.step` (probe on both rows)."),
                  "modes": modes}
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, None)


if __name__ == "__main__":
    main()
