"""Retired: the by-hand CPU micro-benchmark of one LoGRA step against one dense AdamW step.

It timed a hand-written step (a stack of SwiGLU MLP blocks, the loss ``sum(y^2)``, and
LoGRA's ``prepare_update`` / ``apply_update`` without the KL probe) beside dense AdamW,
alternating the two in one process, with per-pair contention and a matrix-multiply FLOP
model. That is the measurement ``speed.py`` makes, now on GRPOModule's own step replayed
by the harness (one step, LoGRA vs dense AdamW, A/B in one process, paired ratios, other
processes' load and the quiet-repetition ratio), so it is folded into ``speed.py``; the
analytic ``memory_report`` rows it printed are ``memory.py``'s.

This module only re-renders the two committed results, measured with that step:

    python -m benchmarks.core_step --render benchmarks/results/core_step.json
    python -m benchmarks.core_step --render benchmarks/results/core_step_1thread.json --name core_step_1thread
"""

from __future__ import annotations

from pathlib import Path

from .harness import argument_parser, load_json, machine_line, pyplot, save_figure, write_outputs

PIECES = ("forward", "backward", "prepare_update", "step")
MODES = ("logra", "dense")
RETIRED = ("Step: the retired `core_step.py` step, not GRPOModule's (a hand-written stack of SwiGLU MLP blocks, loss "
           "`sum(y^2)`, LoGRA's `prepare_update` + `apply_update` without the KL probe); `speed.py` now makes this "
           "measurement on the library's step.")


def gib(n: int) -> float:
    return n / 2**30


def markdown(result: dict) -> str:
    lines = ["| shape | mode | forward s | backward s | prepare_update s | step s | total s |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in result["timing"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            lines.append(f"| {row['shape']['name']} | {mode} | {m['forward']:.3f} | {m['backward']:.3f} | "
                         f"{m['prepare_update']:.3f} | {m['step']:.3f} | {m['total']:.3f} |")
    if any(row.get("gemm_flops") for row in result["timing"]):
        lines += ["", "Matrix-multiply work per step (GFLOP; elementwise work not counted):", "",
                  "| shape | mode | forward | backward | prepare_update | step | total | LoGRA / dense |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["timing"]:
        flops = row.get("gemm_flops")
        if not flops:
            continue
        for mode in MODES:
            f = flops[mode]
            ratio = f"{row['gemm_flop_ratio']:.3f}" if mode == "logra" else ""
            lines.append(f"| {row['shape']['name']} | {mode} | " + " | ".join(f"{f[p] / 1e9:.1f}" for p in PIECES + ("total",)) + f" | {ratio} |")
    lines += ["", "| shape | LoGRA / dense (ratio of medians) | median of paired ratios | paired ratios | target <= 0.85 "
              "| other processes' load per pair (cores) | ratio over quiet pairs (< 0.25 cores) |",
              "|---|---:|---:|---|---|---|---:|"]
    for row in result["timing"]:
        loads = [c["other_processes_cores"] for c in row["contention"] if c["other_processes_cores"] is not None]
        load = ", ".join(f"{x:.2f}" for x in loads) if loads else "n/a"
        quiet = row["quiet_ratio_logra_over_dense"]
        quiet = f"{quiet:.3f} ({len(row['quiet_pairs'])} pairs)" if quiet is not None else f"n/a ({len(row['quiet_pairs'])} quiet pairs)"
        lines.append(f"| {row['shape']['name']} | {row['ratio_logra_over_dense']:.3f} | {row['median_paired_ratio']:.3f} | "
                     f"{', '.join(f'{r:.2f}' for r in row['paired_ratios'])} | {'met' if row['meets_target'] else 'missed'} | {load} | {quiet} |")
    if result.get("memory"):
        # Columns follow whatever byte fields memory_report returned (its fields may change).
        first = ("logra_state_bytes",)
        last = ("reference_bytes", "dense_adamw_bytes")
        byte_fields = [k for k in result["memory"][0] if k.endswith("_bytes")]
        middle = [k for k in byte_fields if k not in first + last]
        columns = [k for k in first + tuple(middle) + last if k in byte_fields]
        labels = {
            "logra_state_bytes": "LoGRA state (this package)",
            "reference_bytes": "reference: fp32 S + A replicated",
            "dense_adamw_bytes": "dense AdamW: fp32 grad + m + v, sharded",
        }
        lines += ["", "GiB per rank (2^30 bytes), target weights only.", "",
                  "| model | world | target params | " + " | ".join(labels.get(k, k.removesuffix("_bytes")) for k in columns) + " |",
                  "|---|---:|---:|" + "---:|" * len(columns)]
        for r in result["memory"]:
            lines.append(f"| {r['model']} | {r['world_size']} | {r['target_parameters'] / 1e9:.3f} B | "
                         + " | ".join(f"{gib(r[k]):.3f}" for k in columns) + " |")
    code = result.get("code", {})
    lines += ["", f"Core: commit {str(code.get('git_commit'))[:10]}{' + local edits' if code.get('lightning_logra_locally_modified') else ''}. "
              f"{machine_line(result['machine'])}; "
              f"{result['repetitions']} repetitions after {result['warmup']} warm-up pair(s); "
              f"script runtime {result['runtime_s']:.0f} s.",
              "", RETIRED]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    has_memory = bool(result.get("memory"))
    figure, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(13 if has_memory else 6, 4.6), squeeze=False,
                                gridspec_kw={"width_ratios": [1, 1.5]} if has_memory else None)
    axis = axes[0][0]
    labels = [f"{row['shape']['name']}\n{mode}" for row in result["timing"] for mode in MODES]
    bottom = [0.0] * len(labels)
    for piece in PIECES:
        values = [row["medians_s"][mode][piece] for row in result["timing"] for mode in MODES]
        axis.bar(range(len(labels)), values, bottom=bottom, label=piece, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    for index, row in enumerate(result["timing"]):
        axis.text(2 * index + 0.5, max(bottom[2 * index:2 * index + 2]) * 1.02, f"ratio {row['ratio_logra_over_dense']:.2f}",
                  ha="center", fontsize=9)
    axis.set_xticks(range(len(labels)), labels, fontsize=8)
    axis.set_ylabel("seconds per step (median)")
    axis.set_title("one step on CPU: LoGRA (rank 256) vs dense AdamW (retired hand-written step)", fontsize=10)
    axis.set_ylim(0, max(bottom) * 1.4)  # room for the legend above the bars
    if has_memory:
        table_axis = axes[0][1]
        table_axis.axis("off")
        header = ["model", "world", "LoGRA\nstate", "reference\nfp32 S+A", "dense AdamW\ngrad+m+v"]
        cells = [[r["model"], str(r["world_size"]), f"{gib(r['logra_state_bytes']):.2f}",
                  f"{gib(r['reference_bytes']):.2f}", f"{gib(r['dense_adamw_bytes']):.2f}"] for r in result["memory"]]
        table = table_axis.table(cellText=cells, colLabels=header, loc="center", cellLoc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(9)
        table.scale(1, 1.9)
        table_axis.set_title("optimizer-side memory per rank (GiB), target weights only", fontsize=10)
    save_figure(figure, path)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--name", default="core_step", help="output file stem in --out (default core_step)")
    args = parser.parse_args()
    if not args.render:
        parser.error("core_step.py is retired and measures nothing: speed.py measures the step; --render JSON redraws a result")
    write_outputs(args.out / args.name, load_json(args.render), markdown, plot)


if __name__ == "__main__":
    main()
