"""Train-step time: dense AdamW vs LoRA r=256 vs LoGRA r=256 on one model, one process.

The step is GRPOModule's, replayed (``harness``): a fixed rollout batch of
``--micro-batches`` rows of ``--tokens`` tokens (an eighth prompt, the rest completion;
two prompts, half the rows each) goes through ``rl.batch.backward_micro_batches`` one row
per micro-batch (chunked token log-probs, the default GRPO loss, activation checkpointing),
then the update: ``AdamW.step()`` (dense, LoRA) or ``LoGRAOptimizer.step`` with the KL
probe on 2 of the rows (one per prompt), at most ``--probe-max-tokens`` real tokens each
(default: the whole row). The model is ``model_shapes.BENCH_156M`` (float32, 1,024 wide),
or with ``--shape`` a few decoder layers of a real Qwen2.5 model at its real widths, random
weights, vocabulary scaled with the depth (``model_shapes.decoder_slice``). The paper's
proportions are 16 responses trained per rank and 2 probed, at most 4,096 tokens each:

    python -m benchmarks.speed --tokens 2048 --micro-batches 16 --probe-max-tokens 4096 --reps 3 --add
    python -m benchmarks.speed --shape qwen2.5-7b --layers 2 --tokens 2048 --micro-batches 16 --reps 3 --add

The three modes start from the same weights and replay the same rollouts; an untimed
warm-up step (one micro-batch and an update) per mode comes first, then each repetition
runs the three steps back to back in an order that rotates every repetition. Pieces are
timed with ``time.perf_counter`` (CPU ops are synchronous; LoGRA's probe time is its
``StepReport.probe_s``, its update time the rest of its step). Reported: medians over the
repetitions, every sample, LoGRA / dense and LoGRA / LoRA of the median step (with and
without the probe), the probe's share of LoGRA's step, the paired per-repetition ratios,
other processes' load during every step and the ratio over the quiet repetitions.

    python -m benchmarks.speed                         # 2,048 tokens, 4 micro-batches, 5 repetitions
    python -m benchmarks.speed --tokens 8192 --add     # append a row to the existing results
    python -m benchmarks.speed --tokens 2048 --add --rerun   # measure a row again (the earlier one is kept)
    python -m benchmarks.speed --smoke --out /tmp/speed      # every code path on a tiny model, seconds
    python -m benchmarks.speed --render benchmarks/results/speed.json

A row added with ``--add`` keeps its own command, machine and date; its ratios, like every
row's, come from modes timed side by side in that one run. ``--profile`` also writes a
``torch.profiler`` op table of one step per mode (``speed_profile_<mode>.txt``).
"""

from __future__ import annotations

import time
from pathlib import Path

from .harness import (MODES, alternate_modes, argument_parser, build_mode, check_smoke_out, code_version,
                      command_line, contention_line, cpu_caption, default_generations, load_json, machine_info,
                      machine_line, micro_batching, prompt_share, pyplot, random_replay, save_figure, save_json,
                      stacked_bars, step_line, summarise, write_outputs)
from .model_shapes import BENCH_156M, QWEN_SHAPES, SMOKE, decoder_slice

PROBE_RESPONSES = 2
# LoGRA / dense AdamW step: 0.70 for the 4-micro-batch rows (set before this file measured
# anything); in the paper's proportions (16 micro-batches) <= 0.85 with the probe at most
# 10% of LoGRA's step.
TARGETS = {4: {"logra_over_dense": 0.70}, 16: {"logra_over_dense": 0.85, "probe_share_of_logra_step": 0.10}}
BENCH_MODEL = "156M bench model"  # rows measured before --shape existed used it
SHAPES = {name.lower(): name for name in QWEN_SHAPES}


def measure_tokens(tokens: int, micro_batches: int, probe_max_tokens: int | None, reps: int, shape: dict,
                   model_name: str, profile_stem: Path | None = None) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    initial = Qwen2ForCausalLM(Qwen2Config(**shape))
    prompt = prompt_share(tokens)
    generations = default_generations(micro_batches)
    settings = micro_batching(tokens - prompt)
    # The same rollouts for every mode and repetition, scored by the initial weights.
    replay = random_replay(initial, micro_batches, prompt, tokens - prompt, shape["vocab_size"],
                           num_generations=generations, seed=1, settings=settings)
    # Both set explicitly: by default whole rows, since the library's default
    # probe_max_tokens (4,096) would truncate 8k rows.
    probe_max_tokens = probe_max_tokens or tokens
    runners = {}
    for mode in MODES:  # every mode from the same initial weights
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        model.load_state_dict(initial.state_dict())
        runners[mode] = build_mode(mode, model, settings, probe_responses=PROBE_RESPONSES, probe_max_tokens=probe_max_tokens)
    del initial
    run = alternate_modes(runners, replay, reps, label=f"{model_name}, {tokens} tokens x {micro_batches}")
    row = {"model_name": model_name, "model": shape, "parameters": sum(p.numel() for p in runners["dense"].model.parameters()),
           "tokens_per_micro_batch": tokens, "micro_batches": micro_batches, "probe_max_tokens": probe_max_tokens,
           "step": step_description(replay), **summarise(run["samples"], run["contention"])}
    if profile_stem is not None:
        row["profile_files"] = profile_steps(runners, replay, profile_stem)
    return row


def step_description(replay) -> str:
    return (f"GRPOModule's step on replayed rollouts ({replay.describe()}): `rl.step.run_update`: `backward_micro_batches`, one row per "
            f"micro-batch, loss `grpo`, then `AdamW.step()` or `LoGRAOptimizer.step` (probe on "
            f"{PROBE_RESPONSES} rows, one per prompt).")


def profile_steps(runners: dict, replay, stem: Path) -> dict[str, str]:
    """One step of each mode under ``torch.profiler``; the op tables go next to the results."""
    from torch.profiler import ProfilerActivity, profile

    files = {}
    for mode, runner in runners.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            runner.step(replay)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        path = stem.parent / f"{stem.name}_profile_{mode}.txt"
        path.write_text(f"# {mode}: one step under torch.profiler (CPU)\n\n{table}\n")
        files[mode] = path.name
    return files


def micro_batches_of(row: dict) -> int:
    return row.get("micro_batches", 4)  # rows measured before the option existed had 4


def model_of(row: dict) -> str:
    return row.get("model_name", BENCH_MODEL)


def row_key(row: dict) -> tuple[str, int, int]:
    return model_of(row), row["tokens_per_micro_batch"], micro_batches_of(row)


def row_label(row: dict) -> str:
    return f"{model_of(row)}, {row['tokens_per_micro_batch']} tokens x {micro_batches_of(row)} micro-batches"


def model_line(row: dict) -> str:
    shape, name = row["model"], model_of(row)
    line = (f"Model {name}: {row['parameters'] / 1e6:,.0f}M parameters, float32, random weights; hidden "
            f"{shape['hidden_size']:,}, intermediate {shape['intermediate_size']:,}, vocabulary {shape['vocab_size']:,}")
    real = next((QWEN_SHAPES[key] for key in QWEN_SHAPES if name.startswith(key + ",")), None)
    if real is not None:
        line += (f" ({real['vocab_size']:,} x {shape['num_hidden_layers']}/{real['num_hidden_layers']} layers, so the "
                 "output head keeps its share of the real model's linear work)")
    return line + "."


def shape_arguments(parser, args) -> tuple[dict, str]:
    """The model ``--smoke``, ``--shape`` and ``--layers`` ask for, and its name in the results."""
    if args.smoke:
        return SMOKE, "smoke model"
    if args.shape is None:
        if args.layers is not None:
            parser.error("--layers needs --shape (the 156M bench model has its own 8 layers)")
        return BENCH_156M, BENCH_MODEL
    name, layers = SHAPES[args.shape], args.layers or 2
    try:
        shape = decoder_slice(name, layers)
    except ValueError as error:
        parser.error(f"--layers: {error}")
    return shape, f"{name}, {layers} layers"


def render(result: dict) -> str:
    lines = [
        "| model | tokens / micro-batch | micro-batches | mode | forward + backward s | update s | KL probe s | step s |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            lines.append(f"| {model_of(row)} | {row['tokens_per_micro_batch']} | {micro_batches_of(row)} | {mode} | {m['forward_backward']:.1f} | "
                         f"{m['update']:.2f} | {m['kl_probe']:.1f} | {m['step']:.1f} |")
    lines += ["", ("| model | tokens / micro-batch | micro-batches | LoGRA / dense | without probe | LoGRA / LoRA | without probe | "
                   "probe share of LoGRA step |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {model_of(row)} | {row['tokens_per_micro_batch']} | {micro_batches_of(row)} | **{row['logra_over_dense']:.3f}** | "
                     f"{row['logra_over_dense_without_probe']:.3f} | {row['logra_over_lora']:.3f} | "
                     f"{row['logra_over_lora_without_probe']:.3f} | {100 * row['probe_share_of_logra_step']:.0f}% |")
    lines.append("")
    for row in result["rows"]:
        verdicts = [f"{name.replace('_', ' ')} <= {limit}: {'met' if row[name] <= limit else 'missed'} ({row[name]:.3f})"
                    for name, limit in TARGETS.get(micro_batches_of(row), {}).items()]
        if verdicts:
            lines.append(f"Targets, {row_label(row)}: " + "; ".join(verdicts) + ".")
    for row in result["rows"]:
        pairs = contention_line(row)
        if pairs:
            lines.append(f"Row {row_label(row)}: {pairs}.")
    lines += [
        "",
        (f"{machine_line(result['machine'])}; median of {result['reps']} repetitions, micro-batches of one sequence, "
         f"probe on {PROBE_RESPONSES} sequences; command: `{result['command']}`."),
    ]
    if result.get("smoke"):
        lines.append("**Smoke run on a tiny model: no figure here is a measurement.**")
    for row in result["rows"]:
        if "added" in row:
            added = row["added"]
            lines.append(f"Row {row_label(row)} was measured in a separate run: "
                         f"{machine_line(added['machine'])}; median of {added['reps']} repetitions; command: `{added['command']}`."
                         + (f" {added['note']}" if "note" in added else ""))
        if "earlier" in row:
            earlier = row["earlier"]
            lines.append(f"Row {row_label(row)} replaces an earlier measurement "
                         f"({machine_line(earlier['machine'])}): LoGRA / dense {earlier['logra_over_dense']:.3f} "
                         f"({earlier['logra_over_dense_without_probe']:.3f} without the probe), probe share "
                         f"{100 * earlier['probe_share_of_logra_step']:.0f}%; its samples are in results/speed.json.")
    described = {}
    for row in result["rows"]:
        if "model" in row and model_of(row) not in described and not result.get("smoke"):
            described[model_of(row)] = model_line(row)
    lines += list(described.values())
    steps = {step_line(row) for row in result["rows"]}
    if len(steps) == 1:
        lines.append(f"Step: {steps.pop()}")
    else:
        lines += [f"Step of row {row_label(row)}: {step_line(row)}" for row in result["rows"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
    for axis, row in zip(axes[0], rows):
        stacked_bars(axis, list(MODES), {piece.replace("_", " "): [row["medians_s"][mode][piece] for mode in MODES]
                                         for piece in ("forward_backward", "update", "kl_probe")})
        axis.set_ylabel("median seconds per step")
        axis.set_ylim(0, 1.3 * max(row["medians_s"][mode]["step"] for mode in MODES))  # room for the legend
        measured = row.get("added", result)["machine"]  # rows added later carry their own machine and date
        axis.set_title(f"{model_of(row)}\n{row['tokens_per_micro_batch']} tokens x {micro_batches_of(row)} micro-batches, {cpu_caption(measured)}\n"
                       f"LoGRA / dense {row['logra_over_dense']:.2f} ({row['logra_over_dense_without_probe']:.2f} without probe)",
                       fontsize=9)
    save_figure(figure, path, "Train step, random-weight Qwen2 models (commands and machines: speed.md)")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per row (default 2048; smoke: 64)")
    parser.add_argument("--micro-batches", type=int, default=4, help="rows trained per step (one per micro-batch)")
    parser.add_argument("--probe-max-tokens", type=int, help="LoGRA's probe_max_tokens (default: the whole row)")
    parser.add_argument("--reps", type=int, default=None, help="measured repetitions (default 5; smoke: 2)")
    parser.add_argument("--add", action="store_true", help="append the measured rows to speed.json instead of replacing it")
    parser.add_argument("--rerun", action="store_true", help="with --add: replace rows already measured (the earlier one is kept in the new row)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, all cores)")
    parser.add_argument("--profile", action="store_true", help="also write a torch.profiler op table of one step per mode")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="decoder layers of this Qwen2.5 model at its real widths "
                        "(default: the 156M bench model)")
    parser.add_argument("--layers", type=int, help="with --shape: how many decoder layers (default 2)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model (model_shapes.SMOKE): checks the code paths, measures nothing")
    args = parser.parse_args()
    check_smoke_out(parser, args)
    stem = args.out / "speed"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    if args.threads or args.smoke:  # a tiny model's many small ops run fastest on one thread
        import torch

        torch.set_num_threads(args.threads or 1)
    shape, model_name = shape_arguments(parser, args)
    token_rows = args.tokens or [64 if args.smoke else 2048]
    reps = args.reps or (2 if args.smoke else 5)
    profile = stem if args.profile else None
    if args.add:
        result = load_json(stem.with_suffix(".json"))
        measured = {row_key(row) for row in result["rows"]} & {(model_name, tokens, args.micro_batches) for tokens in token_rows}
        if measured and not args.rerun:
            parser.error(f"--add: {stem}.json already has rows for (model, tokens, micro-batches) {sorted(measured)}; "
                         "--rerun replaces them, keeping the earlier measurement inside the new row")
        for tokens in token_rows:
            started = time.perf_counter()
            row = measure_tokens(tokens, args.micro_batches, args.probe_max_tokens, reps, shape, model_name, profile)
            row["added"] = {"command": command_line("speed"), "machine": machine_info(), "code": code_version(),
                            "reps": reps, "runtime_s": time.perf_counter() - started}
            earlier = [old for old in result["rows"] if row_key(old) == row_key(row)]
            if earlier:
                row["earlier"] = earlier[0] | {"machine": earlier[0].get("added", result)["machine"]}
                result["rows"] = [row if old is earlier[0] else old for old in result["rows"]]
            else:
                result["rows"].append(row)
            save_json(stem.with_suffix(".json"), result)
    else:
        started = time.perf_counter()
        rows = [measure_tokens(tokens, args.micro_batches, args.probe_max_tokens, reps, shape, model_name, profile)
                for tokens in token_rows]
        result = {"command": command_line("speed"), "machine": machine_info(), "code": code_version(), "reps": reps,
                  "smoke": args.smoke, "model": shape, "rows": rows, "runtime_s": time.perf_counter() - started}
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
