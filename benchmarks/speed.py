"""Train-step time: dense AdamW vs LoRA r=256 vs LoGRA r=256 on one model, one process.

The memory benchmark's setting (``model_shapes.BENCH_156M``, float32, activation
checkpointing and chunked log-probs in every mode, a REINFORCE-shaped loss). One step =
forward + backward over ``--micro-batches`` micro-batches of one sequence each (default 4),
then the update: AdamW ``step`` + ``zero_grad`` (dense, LoRA), or the library's
``LoGRAOptimizer.step`` (prepare, KL probe on 2 of the step's sequences, scale, apply;
``common.Runner.step``). The probe takes at most ``--probe-max-tokens`` real tokens per
sequence (default: the whole sequence). The paper's proportions are 16 responses trained
per rank and 2 probed, at most 4,096 tokens each:

    python benchmarks/speed.py --tokens 2048 --micro-batches 16 --probe-max-tokens 4096 --reps 3 --add

The three modes start from the same weights and see the same tokens. Each repetition runs
the three steps back to back, in an order that rotates from one repetition to the next, so
drift and order effects fall on every mode alike; an untimed warm-up (one micro-batch and
an update) per mode comes first. Pieces are timed with ``time.perf_counter`` (CPU ops are
synchronous; LoGRA's probe time is the step report's ``probe_s``, its update time the rest
of the step). Reported: medians over the repetitions, every sample, LoGRA / dense and
LoGRA / LoRA of the median step (with and without the probe) and the probe's share of
LoGRA's step.

Other rows:

    python benchmarks/speed.py                   # 2,048 tokens per micro-batch, 4 micro-batches, 5 repetitions
    python benchmarks/speed.py --tokens 8192 --add   # append a row to the existing results
    python benchmarks/speed.py --tokens 2048 --add --rerun   # measure a row again (the earlier one is kept)

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
PROBE_RESPONSES = 2
# LoGRA / dense AdamW step: 0.70 for the 4-micro-batch rows (set before this file measured
# anything); in the paper's proportions (16 micro-batches) <= 0.85 with the probe at most
# 10% of LoGRA's step.
TARGETS = {4: {"logra_over_dense": 0.70}, 16: {"logra_over_dense": 0.85, "probe_share_of_logra_step": 0.10}}


def measure_tokens(tokens: int, micro_batches: int, probe_max_tokens: int | None, reps: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    state = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M)).state_dict()

    def model():
        fresh = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M))
        fresh.load_state_dict(state)
        return fresh

    # Both set explicitly: by default whole sequences, since the library's default
    # probe_max_tokens (4,096) would truncate 8k rows.
    probe_max_tokens = probe_max_tokens or tokens
    runners = {mode: build_mode(mode, model(), probe_responses=PROBE_RESPONSES, probe_max_tokens=probe_max_tokens) for mode in MODES}
    del state
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[list[torch.Tensor], torch.Tensor]:
        return ([torch.randint(0, BENCH_156M["vocab_size"], (1, tokens), generator=generator) for _ in range(micro_batches)],
                torch.randn(micro_batches, generator=generator))

    samples = alternate_modes(runners, batch, reps, label=f"{tokens} tokens x {micro_batches}")
    return {"tokens_per_micro_batch": tokens, "micro_batches": micro_batches, "probe_max_tokens": probe_max_tokens,
            **summarise_samples(samples)}


def micro_batches_of(row: dict) -> int:
    return row.get("micro_batches", 4)  # rows measured before the option existed had 4


def row_key(row: dict) -> tuple[int, int]:
    return row["tokens_per_micro_batch"], micro_batches_of(row)


def render(result: dict) -> str:
    lines = [
        "| tokens / micro-batch | micro-batches | mode | forward + backward s | update s | KL probe s | step s |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            lines.append(f"| {row['tokens_per_micro_batch']} | {micro_batches_of(row)} | {mode} | {m['forward_backward']:.1f} | "
                         f"{m['update']:.2f} | {m['kl_probe']:.1f} | {m['step']:.1f} |")
    lines += ["", ("| tokens / micro-batch | micro-batches | LoGRA / dense | without probe | LoGRA / LoRA | without probe | "
                   "probe share of LoGRA step |"), "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['tokens_per_micro_batch']} | {micro_batches_of(row)} | **{row['logra_over_dense']:.3f}** | "
                     f"{row['logra_over_dense_without_probe']:.3f} | {row['logra_over_lora']:.3f} | "
                     f"{row['logra_over_lora_without_probe']:.3f} | {100 * row['probe_share_of_logra_step']:.0f}% |")
    lines.append("")
    for row in result["rows"]:
        verdicts = [f"{name.replace('_', ' ')} <= {limit}: {'met' if row[name] <= limit else 'missed'} ({row[name]:.3f})"
                    for name, limit in TARGETS.get(micro_batches_of(row), {}).items()]
        if verdicts:
            lines.append(f"Targets, {row['tokens_per_micro_batch']} tokens x {micro_batches_of(row)} micro-batches: " + "; ".join(verdicts) + ".")
    lines += [
        "",
        (f"{machine_line(result['machine'])}; median of {result['reps']} repetitions, micro-batches of one sequence, "
         f"probe on {PROBE_RESPONSES} sequences; command: `{result['command']}`."),
    ]
    for row in result["rows"]:
        if "added" in row:
            added = row["added"]
            lines.append(f"Row {row['tokens_per_micro_batch']} x {micro_batches_of(row)} was measured in a separate run: "
                         f"{machine_line(added['machine'])}; median of {added['reps']} repetitions; command: `{added['command']}`."
                         + (f" {added['note']}" if "note" in added else ""))
        if "earlier" in row:
            earlier = row["earlier"]
            lines.append(f"Row {row['tokens_per_micro_batch']} x {micro_batches_of(row)} replaces an earlier measurement "
                         f"({machine_line(earlier['machine'])}): LoGRA / dense {earlier['logra_over_dense']:.3f} "
                         f"({earlier['logra_over_dense_without_probe']:.3f} without the probe), probe share "
                         f"{100 * earlier['probe_share_of_logra_step']:.0f}%; its samples are in results/speed.json.")
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
        axis.set_ylim(0, 1.3 * max(row["medians_s"][mode]["step"] for mode in MODES))  # room for the legend
        measured = row.get("added", result)["machine"]  # rows added later carry their own machine and date
        axis.set_title(f"{row['tokens_per_micro_batch']} tokens x {micro_batches_of(row)} micro-batches, {cpu_caption(measured)}\n"
                       f"LoGRA / dense {row['logra_over_dense']:.2f} ({row['logra_over_dense_without_probe']:.2f} without probe)",
                       fontsize=9)
    save_figure(figure, path, "Train step, 156M Qwen2 (commands and machines: speed.md)")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--micro-batches", type=int, default=4, help="sequences trained per step (one per micro-batch)")
    parser.add_argument("--probe-max-tokens", type=int, help="LoGRA's probe_max_tokens (default: the whole sequence)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--add", action="store_true", help="append the measured rows to results/speed.json instead of replacing it")
    parser.add_argument("--rerun", action="store_true", help="with --add: replace rows already measured (the earlier one is kept in the new row)")
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/speed.py", *sys.argv[1:]])
    if args.render:
        result = json.loads(args.render.read_text())
    elif args.add:
        result = json.loads((RESULTS / "speed.json").read_text())
        measured = {row_key(row) for row in result["rows"]} & {(tokens, args.micro_batches) for tokens in args.tokens}
        if measured and not args.rerun:
            parser.error(f"--add: results/speed.json already has rows for (tokens, micro-batches) {sorted(measured)}; "
                         "--rerun replaces them, keeping the earlier measurement inside the new row")
        for tokens in args.tokens:
            started = time.perf_counter()
            row = measure_tokens(tokens, args.micro_batches, args.probe_max_tokens, args.reps)
            row["added"] = {"command": command, "machine": machine_info(),
                            "reps": args.reps, "runtime_s": time.perf_counter() - started}
            earlier = [old for old in result["rows"] if row_key(old) == row_key(row)]
            if earlier:
                row["earlier"] = earlier[0] | {"machine": earlier[0].get("added", result)["machine"]}
                result["rows"] = [row if old is earlier[0] else old for old in result["rows"]]
            else:
                result["rows"].append(row)
            save_json(RESULTS / "speed.json", result)
    else:
        started = time.perf_counter()
        rows = [measure_tokens(tokens, args.micro_batches, args.probe_max_tokens, args.reps) for tokens in args.tokens]
        result = {"command": command, "machine": machine_info(), "reps": args.reps,
                  "rows": rows, "runtime_s": time.perf_counter() - started}
        save_json(RESULTS / "speed.json", result)
    write_outputs(RESULTS / "speed", result, render, plot)


if __name__ == "__main__":
    main()
