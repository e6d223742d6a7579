"""Train-step time: dense AdamW vs LoRA r=256 vs LoGRA r=256 on one model, one process.

The memory benchmark's setting (``model_shapes.BENCH_156M``, float32, activation
checkpointing and chunked log-probs in every mode, a REINFORCE-shaped loss). One step =
forward + backward over 4 micro-batches of one sequence each, then the update: AdamW
``step`` + ``zero_grad`` (dense, LoRA), or the library's ``LoGRAOptimizer.step`` (prepare,
KL probe on 2 of the step's sequences at full length, scale, apply; ``common.Runner.step``).
The three modes start from the same weights and see the same tokens. Each repetition runs
the three steps back to back, in an order that rotates from one repetition to the next, so
drift and order effects fall on every mode alike; an untimed warm-up (one micro-batch and
an update) per mode comes first. Pieces are timed with ``time.perf_counter`` (CPU ops are
synchronous; LoGRA's probe time is the step report's ``probe_s``, its update time the rest
of the step). Reported: medians over the repetitions, every sample, LoGRA / dense and
LoGRA / LoRA of the median step (with and without the probe) and the probe's share of
LoGRA's step.

    python benchmarks/speed.py                   # 2,048 tokens per micro-batch, 5 repetitions
    python benchmarks/speed.py --tokens 2048 8192
    python benchmarks/speed.py --tokens 8192 --add   # append a row to the existing results

A row added with ``--add`` keeps its own command, machine and date; its ratios, like every
row's, come from modes timed side by side in that one run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (MODES, alternate_modes, argument_parser, build_mode, cpu_caption, machine_info,  # noqa: E402
                    machine_line, save_figure, save_json, stacked_bars, summarise_samples, write_outputs)
from model_shapes import BENCH_156M  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MICRO_BATCHES, PROBE_RESPONSES = 4, 2
TARGET = 0.70  # LoGRA / dense


def measure_tokens(tokens: int, reps: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    state = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M)).state_dict()

    def model():
        fresh = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M))
        fresh.load_state_dict(state)
        return fresh

    # LoGRA probes PROBE_RESPONSES whole sequences, as this benchmark always has: both set
    # explicitly, since the library's default probe_max_tokens (4,096) would truncate 8k rows.
    runners = {mode: build_mode(mode, model(), probe_responses=PROBE_RESPONSES, probe_max_tokens=tokens) for mode in MODES}
    del state
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[list[torch.Tensor], torch.Tensor]:
        return ([torch.randint(0, BENCH_156M["vocab_size"], (1, tokens), generator=generator) for _ in range(MICRO_BATCHES)],
                torch.randn(MICRO_BATCHES, generator=generator))

    samples = alternate_modes(runners, batch, reps, label=f"{tokens} tokens")
    return {"tokens_per_micro_batch": tokens, **summarise_samples(samples)}


def render(result: dict) -> str:
    lines = [
        "| tokens / micro-batch | mode | forward + backward s | update s | KL probe s | step s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            lines.append(f"| {row['tokens_per_micro_batch']} | {mode} | {m['forward_backward']:.1f} | {m['update']:.2f} | "
                         f"{m['kl_probe']:.1f} | {m['step']:.1f} |")
    lines += ["", "| tokens / micro-batch | LoGRA / dense | without probe | LoGRA / LoRA | without probe | probe share of LoGRA step |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['tokens_per_micro_batch']} | **{row['logra_over_dense']:.3f}** | {row['logra_over_dense_without_probe']:.3f} | "
                     f"{row['logra_over_lora']:.3f} | {row['logra_over_lora_without_probe']:.3f} | {100 * row['probe_share_of_logra_step']:.0f}% |")
    first = result["rows"][0]
    lines += [
        "",
        f"Target LoGRA / dense <= {TARGET} ({first['tokens_per_micro_batch']} tokens): "
        f"{'met' if first['logra_over_dense'] <= TARGET else 'missed'} with the probe, "
        f"{'met' if first['logra_over_dense_without_probe'] <= TARGET else 'missed'} without it.",
        "",
        f"{machine_line(result['machine'])}; median of {result['reps']} repetitions, {MICRO_BATCHES} micro-batches of one sequence, "
        f"probe on {PROBE_RESPONSES} sequences; command: `{result['command']}`.",
    ]
    for row in result["rows"]:
        if "added" in row:
            added = row["added"]
            lines.append(f"Row {row['tokens_per_micro_batch']} was measured in a separate run: {machine_line(added['machine'])}; "
                         f"median of {added['reps']} repetitions; command: `{added['command']}`." + (f" {added['note']}" if "note" in added else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
    for axis, row in zip(axes[0], rows):
        stacked_bars(axis, list(MODES), {piece.replace("_", " "): [row["medians_s"][mode][piece] for mode in MODES]
                                         for piece in ("forward_backward", "update", "kl_probe")})
        axis.set_ylabel("median seconds per step")
        axis.set_title(f"{row['tokens_per_micro_batch']} tokens x {MICRO_BATCHES} micro-batches: LoGRA / dense "
                       f"{row['logra_over_dense']:.2f} ({row['logra_over_dense_without_probe']:.2f} without probe)", fontsize=9)
    save_figure(figure, path, f"Train step, 156M Qwen2 - {cpu_caption(result['machine'])}, {result['command']}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--add", action="store_true", help="append the measured rows to results/speed.json instead of replacing it")
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/speed.py", *sys.argv[1:]])
    if args.render:
        result = json.loads(args.render.read_text())
    elif args.add:
        result = json.loads((RESULTS / "speed.json").read_text())
        measured = {row["tokens_per_micro_batch"] for row in result["rows"]}
        if measured & set(args.tokens):
            parser.error(f"--add: results/speed.json already has rows for {sorted(measured & set(args.tokens))} tokens")
        for tokens in args.tokens:
            started = time.perf_counter()
            row = measure_tokens(tokens, args.reps)
            row["added"] = {"command": command, "machine": machine_info(),
                            "reps": args.reps, "runtime_s": time.perf_counter() - started}
            result["rows"].append(row)
            save_json(RESULTS / "speed.json", result)
    else:
        started = time.perf_counter()
        rows = [measure_tokens(tokens, args.reps) for tokens in args.tokens]
        result = {"command": command, "machine": machine_info(), "reps": args.reps,
                  "rows": rows, "runtime_s": time.perf_counter() - started}
        save_json(RESULTS / "speed.json", result)
    write_outputs(RESULTS / "speed", result, render, plot)


if __name__ == "__main__":
    main()
