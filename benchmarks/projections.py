"""Regenerated projections (``regenerate_projections``): LoGRA's state without the A
matrices, and what drawing each A again at every use costs a step.

Two parts, written to ``benchmarks/results/projections.json`` (``.md``, ``.png``):

1. **State** (from shapes, seconds): ``memory_report`` of every ``model_shapes.QWEN_SHAPES``
   entry on 1 and 8 ranks (bf16 compute, rank 256, sharded accumulation as ``logra_fsdp``
   runs it), projections stored vs regenerated; and the same report checked against the
   bytes a real ``LoGRAOptimizer`` allocates (``state_bytes``) on the timed model below.
   Target (issue 43): at most 0.25 GiB per rank at Qwen2.5-7B on 8 ranks.
2. **Step time**: the step of ``speed.py`` (GRPOModule's, replayed: one row per
   micro-batch, activation checkpointing, the probe on 2 rows), LoGRA with stored vs with
   regenerated projections, from the same weights on the same rollouts, side by side in
   one process, the order rotating every repetition. Also timed: one draw of every
   distinct A (what each use costs). Target: regenerated / stored step at most 1.03.

    python -m benchmarks.projections                   # Qwen2.5-7B, 2 layers, 1,024 tokens x 4; ~15 minutes alone
    python -m benchmarks.projections --smoke --out /tmp/projections
    python -m benchmarks.projections --render benchmarks/results/projections.json
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .harness import (alternate_modes, argument_parser, build_mode, check_smoke_out, code_version, command_line,
                      default_generations, load_json, machine_info, machine_line, micro_batching, prompt_share,
                      pyplot, random_replay, save_figure, save_json, write_outputs)
from .model_shapes import QWEN_SHAPES, SMOKE, decoder_slice

GIB = 2**30
RANK = 256
STATE_TARGET_GIB = 0.25  # at Qwen2.5-7B on 8 ranks
STEP_TARGET = 1.03
PROBE_RESPONSES = 2
MODES = {"stored": False, "regenerated": True}


def state_rows() -> list[dict]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import LoGRAConfig, memory_report

    rows = []
    for name, shape in QWEN_SHAPES.items():
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**shape))
        for world in (1, 8):
            for mode, regenerate in MODES.items():
                report = memory_report(model, LoGRAConfig(rank=RANK, regenerate_projections=regenerate),
                                       world_size=world, compute_dtype=torch.bfloat16)
                rows.append({"model": name, "world_size": world, "projections": mode, **report.as_dict()})
    return rows


def measure_step(shape: dict, model_name: str, tokens: int, micro_batches: int, reps: int, rank: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import memory_report

    torch.manual_seed(0)
    initial = Qwen2ForCausalLM(Qwen2Config(**shape))
    prompt = prompt_share(tokens)
    settings = micro_batching(tokens - prompt)
    generations = default_generations(micro_batches)
    replay = random_replay(initial, micro_batches, prompt, tokens - prompt, shape["vocab_size"],
                           num_generations=generations, seed=1, settings=settings)
    runners = {}
    for mode, regenerate in MODES.items():
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        model.load_state_dict(initial.state_dict())
        runners[mode] = build_mode("logra", model, settings, probe_responses=PROBE_RESPONSES, probe_max_tokens=tokens,
                                   rank=rank, regenerate_projections=regenerate)
    del initial
    # The report against what the optimizers allocated (one rank, float32 compute here).
    allocated = {mode: runner.optimizer.state_bytes() for mode, runner in runners.items()}
    predicted = {mode: memory_report(runner.model, runner.optimizer.config, compute_dtype=torch.float32).logra_state_bytes
                 for mode, runner in runners.items()}
    draw_s = time_draws(runners["regenerated"].optimizer)
    run = alternate_modes(runners, replay, reps, label=f"{model_name}, {tokens} tokens x {micro_batches}")
    steps = {mode: [sample["step"] for sample in samples] for mode, samples in run["samples"].items()}
    paired = [regenerated / stored for stored, regenerated in zip(steps["stored"], steps["regenerated"])]
    medians = {mode: statistics.median(values) for mode, values in steps.items()}
    return {"model_name": model_name, "model": shape, "rank": rank, "tokens_per_micro_batch": tokens, "micro_batches": micro_batches,
            "reps": reps, "samples": run["samples"], "contention": run["contention"], "median_step_s": medians,
            "regenerated_over_stored": medians["regenerated"] / medians["stored"], "paired_ratios": paired,
            "allocated_state": allocated, "predicted_state_bytes": predicted, "one_draw_of_every_a_s": draw_s,
            "distinct_projections": len(runners["stored"].optimizer.sketches.projections())}


def time_draws(optimizer, repeats: int = 3) -> float:
    """Median seconds to draw every distinct A once (what one use of all of them costs)."""
    sources = [source for _, source in optimizer.sketches.projections()]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for source in sources:
            source.matrix()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def render(result: dict) -> str:
    lines = ["# Regenerated projections: LoGRA's state without A, and the step-time cost", ""]
    lines += ["## State per rank (`memory_report`, bf16 compute, rank 256)", "",
              "| model | ranks | projections stored GiB | state stored GiB | state regenerated GiB | one draw's transient MiB |",
              "|---|---:|---:|---:|---:|---:|"]
    cells = {(row["model"], row["world_size"], row["projections"]): row for row in result["state"]}
    for (model, world) in dict.fromkeys((row["model"], row["world_size"]) for row in result["state"]):
        stored, regenerated = cells[(model, world, "stored")], cells[(model, world, "regenerated")]
        lines.append(f"| {model} | {world} | {stored['projection_bytes'] / GIB:.3f} | {stored['logra_state_bytes'] / GIB:.3f} | "
                     f"**{regenerated['logra_state_bytes'] / GIB:.3f}** | {regenerated['projection_draw_bytes'] / 2**20:.1f} |")
    seven = cells.get(("Qwen2.5-7B", 8, "regenerated"))
    if seven:
        value = seven["logra_state_bytes"] / GIB
        lines += ["", f"Qwen2.5-7B on 8 ranks, regenerated: {value:.3f} GiB per rank (target <= {STATE_TARGET_GIB}: "
                      f"{'met' if value <= STATE_TARGET_GIB else 'missed'}; a prediction from shapes, checked below "
                      "against allocated bytes at a smaller shape)."]
    step = result.get("step")
    if step:
        ratio = step["regenerated_over_stored"]
        lines += ["", f"## Step time: {step['model_name']}, {step['tokens_per_micro_batch']:,} tokens x "
                      f"{step['micro_batches']} micro-batches (CPU)", "",
                  "| projections | median step s | samples s | LoGRA state allocated MiB | predicted MiB |",
                  "|---|---:|---|---:|---:|"]
        for mode in MODES:
            samples = ", ".join(f"{sample['step']:.1f}" for sample in step["samples"][mode])
            lines.append(f"| {mode} | {step['median_step_s'][mode]:.1f} | {samples} | "
                         f"{step['allocated_state'][mode]['total'] / 2**20:,.1f} | "
                         f"{step['predicted_state_bytes'][mode] / 2**20:,.1f} |")
        equal = all(step["allocated_state"][mode]["total"] == step["predicted_state_bytes"][mode] for mode in MODES)
        lines += ["", f"`memory_report` against the bytes the optimizers allocated: {'equal' if equal else 'DIFFERENT'} "
                      "in both modes.",
                  "", f"Regenerated / stored step: **{ratio:.3f}** (paired per repetition "
                      f"{', '.join(f'{r:.3f}' for r in step['paired_ratios'])}; target <= {STEP_TARGET}: "
                      f"{'met' if ratio <= STEP_TARGET else 'missed'}). One draw of all "
                      f"{step['distinct_projections']} distinct A takes {step['one_draw_of_every_a_s']:.3f} s here; "
                      "a step draws each A once per micro-batch (in backward, under activation checkpointing), once "
                      "in the probe and once in the update.",
                  f"{machine_line(result['machine'])}; command: `{result['command']}`; commit "
                  f"{result['code'].get('git_commit', '?')}.",
                  "Not measured: the cost on a GPU, where the draw stays on the CPU (a CPU generator keeps A the same "
                  "on every device) and the step is far shorter."]
    if result.get("smoke"):
        lines.append("**Smoke run on a tiny model: no figure here is a measurement.**")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.5))
    rows = [row for row in result["state"] if row["world_size"] == 8]
    models = list(dict.fromkeys(row["model"] for row in rows))
    for offset, mode in ((-0.2, "stored"), (0.2, "regenerated")):
        values = [next(row["logra_state_bytes"] for row in rows if row["model"] == model and row["projections"] == mode) / GIB
                  for model in models]
        axis.bar([i + offset for i in range(len(models))], values, width=0.4, label=f"A {mode}")
    axis.axhline(STATE_TARGET_GIB, color="grey", linestyle="--", linewidth=1, label="target at 7B")
    axis.set_xticks(range(len(models)), models, fontsize=8)
    axis.set_ylabel("LoGRA state, GiB per rank (8 ranks)")
    axis.legend(fontsize=8)
    save_figure(figure, path, "LoGRA's state per rank, projections stored vs regenerated (memory_report)")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--shape", default="Qwen2.5-7B", choices=sorted(QWEN_SHAPES), help="the timed model's widths")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the timed model")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per row")
    parser.add_argument("--micro-batches", type=int, default=4, help="rows per step, one per micro-batch")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, measuring nothing")
    args = parser.parse_args()
    check_smoke_out(parser, args)
    stem = args.out / "projections"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    shape, name = ((dict(SMOKE), "smoke model") if args.smoke
                   else (decoder_slice(args.shape, args.layers), f"{args.shape}, {args.layers} layers"))
    tokens, reps = (32, 2) if args.smoke else (args.tokens, args.reps)
    if args.smoke:
        import torch

        torch.set_num_threads(1)
    result = {"command": command_line("projections"), "machine": machine_info(), "code": code_version(),
              "smoke": args.smoke, "state": state_rows(),
              "step": measure_step(shape, name, tokens, args.micro_batches, reps, 16 if args.smoke else RANK)}
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
