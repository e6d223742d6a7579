"""What occupies memory, phase by phase, in one RL step of each mode (the memory benchmark's setting).

The step of ``memory.py`` (156M Qwen2, float32, 2 micro-batches of 2,048 tokens,
activation checkpointing, the probe on both sequences), run once under ``torch.profiler``
with ``profile_memory=True``. Every tensor allocation and free is an event of the CPU
allocator, with the op that made it and the phase it happened in, so the ledger is
measured, not estimated:

- phases: the forward and the backward of each micro-batch, then dense AdamW's / LoRA's
  optimizer step, or LoGRA's prepare, probe and apply;
- per phase: the bytes live at its start, at its peak and at its end;
- at each phase's peak: what is live, grouped by where it was allocated (before the step:
  weights and optimizer or LoGRA state, by inventory; during it: phase and op).

``logra_mlp_whole`` is LoGRA with the probe's MLPs over whole rows (``probe_mlp_chunk``
as long as a row), as before MLPs ran in token chunks, to show what the chunking removes.

    python benchmarks/memory_ledger.py    # about 5 minutes on 2 cores; writes results/memory_ledger.{json,md}
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import MODES, argument_parser, build_mode, machine_info, machine_line, save_json  # noqa: E402
from model_shapes import BENCH_156M  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 2**20
TOKENS, MICRO_BATCHES = 2048, 2
PHASE = "ledger/"  # prefix of the record_function ranges that name the phases
TOP = 8  # groups listed per phase peak
LEDGER_MODES = (*MODES, "logra_mlp_whole")


def _timed_phases(runner):
    """The LoGRA step's pieces as profiler ranges (this instance only)."""
    import torch

    optimizer = runner.optimizer
    for name, label in (("prepare_update", "prepare"), ("predict_kl", "probe"), ("apply_update", "apply")):
        method = getattr(optimizer, name)

        def wrapped(*args, _method=method, _label=label, **kwargs):
            with torch.profiler.record_function(PHASE + _label):
                return _method(*args, **kwargs)

        setattr(optimizer, name, wrapped)


def run_mode(mode: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import ProbeBatch
    from lightning_logra.rl.logprobs import sequence_logprobs

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, BENCH_156M["vocab_size"], (1, TOKENS), generator=generator) for _ in range(MICRO_BATCHES)]
    advantages = torch.randn(MICRO_BATCHES, generator=generator)
    runner = build_mode(mode.split("_")[0], Qwen2ForCausalLM(Qwen2Config(**BENCH_156M)), probe_responses=MICRO_BATCHES,
                        probe_max_tokens=TOKENS)
    model, logra = runner.model, runner.logra
    if logra is not None:
        _timed_phases(runner)
        if mode == "logra_mlp_whole":
            logra.config.probe_mlp_chunk = TOKENS  # read when the probe runs
    else:  # AdamW's state exists from its first step on: a warm-up step makes it pre-existing, as in training
        sequence_logprobs(model, batches[0][:, :8], torch.ones_like(batches[0][:, :8])).sum().backward()
        runner.optimizer.step()
        runner.optimizer.zero_grad(set_to_none=True)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        for index, (sequence, advantage) in enumerate(zip(batches, advantages)):
            with torch.profiler.record_function(f"{PHASE}forward {index}"):
                logprobs = sequence_logprobs(model, sequence, torch.ones_like(sequence))
                loss = -(advantage * logprobs).mean() / MICRO_BATCHES
            with torch.profiler.record_function(f"{PHASE}backward {index}"):
                loss.backward()
            del logprobs, loss
        if logra is None:
            with torch.profiler.record_function(PHASE + "optimizer step"):
                runner.optimizer.step()
                runner.optimizer.zero_grad(set_to_none=True)
        else:
            report = logra.step(probe=ProbeBatch.from_token_batch(torch.cat(batches)), normalization_tokens=MICRO_BATCHES * TOKENS)
            if report.skipped:
                raise RuntimeError(f"LoGRA skipped the ledger's step: {report.skip_reason}")

    inventory = {"weights": sum(p.numel() * p.element_size() for p in model.parameters())}
    if logra is None:
        inventory["optimizer state"] = sum(t.numel() * t.element_size() for s in runner.optimizer.state.values()
                                           for t in s.values() if torch.is_tensor(t))
    else:
        inventory["LoGRA sketch buffer"] = logra.sketches.buffer.numel() * 4
        inventory["LoGRA projections"] = sum(p.numel() * p.element_size() for _, p in logra.sketches.projections())
        inventory["LoGRA row moments"] = sum(s.second_moment.numel() * 4 for s in logra.sketches)
    return {"mode": mode, "inventory_bytes": inventory, **ledger(profiler)}


def _allocations(profiler) -> list[tuple[int, int, int, str, str]]:
    """(time ns, bytes (+ alloc, - free), ptr, phase, op) of every CPU allocator event, in time order."""
    from torch._C._profiler import _EventType

    events = []
    stack = [(root, None, None) for root in profiler.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, phase, op = stack.pop()
        name = event.name
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.alloc_size, fields.ptr, phase or "outside the phases", op or "-"))
            continue
        if name.startswith(PHASE):
            phase, op = name[len(PHASE):], None
        elif event.typed[0] == _EventType.TorchOp and op is None:
            op = name  # the outermost op of the phase that this allocation happened under
        stack.extend((child, phase, op) for child in event.children)
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
    return "\n".join(lines)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--mode", choices=LEDGER_MODES, help="run one mode in this process and print its JSON")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode)))
        return
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        modes = []
        for mode in LEDGER_MODES:
            completed = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True)
            if completed.returncode != 0:
                raise SystemExit(f"mode {mode} failed:\n{completed.stderr[-3000:]}")
            modes.append(json.loads(completed.stdout.strip().splitlines()[-1]))
            print(f"{mode}: peak {max(p['peak_bytes'] for p in modes[-1]['phases']) / MIB:,.0f} MiB above the step's start", flush=True)
        result = {"command": " ".join(["python", "benchmarks/memory_ledger.py", *sys.argv[1:]]), "machine": machine_info(),
                  "modes": modes}
        save_json(RESULTS / "memory_ledger.json", result)
    table = render(result)
    (RESULTS / "memory_ledger.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
