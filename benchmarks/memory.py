"""Training memory of one RL step: dense AdamW vs LoRA r=256 vs LoGRA r=256.

Each mode runs in its own fresh process. The step is GRPOModule's, replayed
(``harness.Runner.step``): a fixed rollout batch of 2 rows of 2,048 tokens (256 prompt +
1,792 completion, one prompt, two generations) through ``rl.batch.backward_micro_batches``
one row per micro-batch (chunked, checkpointed token log-probs, the default GRPO loss,
backward with activation checkpointing), then the optimizer step: ``AdamW.step()``, or
``LoGRAOptimizer.step`` with its KL probe on both rows. Rollout generation is excluded.
The model is fixed before measuring
(``model_shapes.BENCH_156M``): a random-init Qwen2, hidden 1024, intermediate 2816, 8
layers, 16 heads, 4 KV heads, vocabulary 32000, untied embeddings (155.7M parameters),
float32.

Training memory (CPU) = the process's peak RSS minus its RSS just before the model is
built. Children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every
freed tensor to the system: peak RSS then tracks live tensors, as
``torch.cuda.max_memory_allocated`` does on a GPU, instead of whatever the heap kept
after earlier frees (``--glibc-default`` measures with glibc's adaptive threshold). The
breakdown counts tensor bytes: weights, gradients, optimizer state, LoGRA state;
activations and other temporaries are the rest of the peak. Step seconds are printed for
orientation only: this allocator setting slows large allocations (speed: ``speed.py``).

With ``--world 2`` it measures the same step on 2 gloo processes (``memory_ranks.py``):
the peak per rank of dense AdamW, LoRA and LoGRA with sharded and local sketch
accumulation, and the sketch traffic per step, added to an existing results file.

The last part is analytic: LoGRA's per-rank state (``memory_report``) for Qwen2.5-1.5B,
7B, 14B and a 27B-class config at world sizes 1 and 8, built on the meta device, beside
the reference's replicated float32 layout and dense AdamW's gradient + moments.

    python -m benchmarks.memory              # writes benchmarks/results/memory.{json,md,png}
    python -m benchmarks.memory --world 2    # adds the 2-process rows to them
    python -m benchmarks.memory --smoke --out /tmp/memory   # every code path on a tiny model, seconds
    python -m benchmarks.memory --render benchmarks/results/memory.json
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

from .harness import (MODES, RANK, argument_parser, build_mode, check_smoke_out, code_version, command_line,
                      cpu_caption, load_json, machine_info, machine_line, meta_memory_rows, micro_batching,
                      optimizer_state_bytes, prompt_share, pyplot, random_replay, run_module, save_figure, save_json,
                      stacked_bars, step_line, write_outputs)
from .memory_ranks import RANK_MODES, measure_ranks
from .model_shapes import BENCH_156M, QWEN_SHAPES, SMOKE

MIB = 2**20
TOKENS, MICRO_BATCHES = 2048, 2
SMOKE_TOKENS = 64
DENSE_TARGET = 0.40  # LoGRA / dense AdamW, the probe included


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / MIB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def run_mode(mode: str, logprob_chunk: int, smoke: bool = False) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape, tokens = (SMOKE, SMOKE_TOKENS) if smoke else (BENCH_156M, TOKENS)
    prompt = prompt_share(tokens)
    settings = micro_batching(tokens - prompt, logprob_chunk=logprob_chunk)
    torch.manual_seed(0)
    baseline = rss_mib()
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    # The same rollouts in every mode's process: the same seeds, scored by the same initial weights.
    replay = random_replay(model, MICRO_BATCHES, prompt, tokens - prompt, shape["vocab_size"],
                           num_generations=MICRO_BATCHES, seed=1, settings=settings)
    # LoGRA probes both rows at full length, as this benchmark always has (set explicitly).
    runner = build_mode(mode, model, settings, probe_responses=MICRO_BATCHES, probe_max_tokens=tokens)
    model = runner.model
    phases, gradients = {}, []

    def end_phase(name: str) -> None:
        if name == "forward_backward":  # the gradients exist until the optimizer step
            gradients.append(tensor_mib(p.grad for p in model.parameters() if p.grad is not None))
            phases[name] = peak_rss_mib() - baseline

    seconds = runner.step(replay, phase=end_phase)["step"]
    state = optimizer_state_bytes(runner)
    optimizer_state = 0.0 if runner.logra is not None else state["total"] / MIB
    logra_state = state["total"] / MIB if runner.logra is not None else 0.0
    weights = tensor_mib(model.parameters())
    peak = peak_rss_mib() - baseline
    phases["step"] = peak
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)
        if runner.logra is None else sum(s.weight.numel() for s in runner.logra.sketches),
        "training_memory_mib": peak,
        "peak_after_mib": phases,
        "breakdown_mib": {
            "weights": weights,
            "gradients": gradients[0],
            "optimizer_state": optimizer_state,
            "logra_state": logra_state,
            "activations_and_temporaries": peak - weights - gradients[0] - optimizer_state - logra_state,
        },
        "optimizer_state_bytes": state,
        "step_seconds": seconds,
    }


def render(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        rows = {row["mode"]: row for row in run["modes"]}
        lines += [
            f"### Log-prob chunk {run['logprob_chunk']} positions"
            + (" (the library default)" if run["logprob_chunk"] == result["library_logprob_chunk"] else ""),
            "",
            "| mode | training memory MiB | weights | gradients | optimizer state | LoGRA state | activations + temporaries | peak before optimizer / probe | step s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in MODES:
            row = rows[mode]
            b = row["breakdown_mib"]
            lines.append(
                f"| {mode} | {row['training_memory_mib']:,.0f} | {b['weights']:,.0f} | {b['gradients']:,.0f} | "
                f"{b['optimizer_state']:,.0f} | {b['logra_state']:,.0f} | {b['activations_and_temporaries']:,.0f} | "
                f"{row['peak_after_mib']['forward_backward']:,.0f} | {row['step_seconds']:.1f} |"
            )
        logra = rows["logra"]["training_memory_mib"]
        ratio = logra / rows["dense"]["training_memory_mib"]
        # At this size float32 weights are the floor both LoGRA and LoRA hold: compare what each keeps above them.
        above = {mode: rows[mode]["training_memory_mib"] - rows[mode]["breakdown_mib"]["weights"] for mode in ("logra", "lora")}
        verdicts = [f"LoGRA / dense AdamW = **{ratio:.3f}** (target <= {DENSE_TARGET:.2f}: {'met' if ratio <= DENSE_TARGET else 'missed'})",
                    f"above the weights, LoGRA {above['logra']:,.0f} MiB against LoRA-r256's {above['lora']:,.0f} "
                    f"(target: LoGRA's the smaller: {'met' if above['logra'] < above['lora'] else 'missed'}; "
                    f"LoGRA / LoRA in all {logra / rows['lora']['training_memory_mib']:.3f})"]
        probe = rows["logra"]["peak_after_mib"]
        if "kl_probe" in probe:  # results measured with the earlier step, which read the memory between probe and apply
            peaks = f"LoGRA's peak before the KL probe was {probe['forward_backward']:,.0f} MiB, after it {probe['kl_probe']:,.0f} MiB."
        else:
            peaks = (f"LoGRA's peak before its optimizer step was {probe['forward_backward']:,.0f} MiB, by its end "
                     f"{probe['step']:,.0f} MiB (phase by phase, the probe's own: memory_ledger.md).")
        lines += ["", "; ".join(verdicts) + ".", peaks, ""]
    lines += render_two_ranks(result)
    lines += [
        f"{machine_line(result['machine'])}, allocator: {result['allocator']}; "
        f"model {result['model']}; {result['micro_batches']} x {result['tokens_per_micro_batch']} tokens, rank {RANK}, "
        "activation checkpointing in every mode.",
        *(["**Smoke run on a tiny model: no figure here is a measurement.**"] if result.get("smoke") else []),
        f"Step: {step_line(result)}",
        "",
        "### Analytic per-rank state (meta device, `memory_report`, rank 256, bf16 compute)",
        "",
        "| model | parameters | world | LoGRA state GiB | of it: accumulator + scratch | with local accumulation | "
        "reference layout GiB | dense AdamW grad + moments GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["analytic"]:
        accumulator = row["sketch_accumulator_bytes"] + row.get("accumulation_scratch_bytes", 0)
        local = row.get("logra_state_local_bytes", row["logra_state_bytes"])
        lines.append(f"| {row['model']} | {row['parameters'] / 1e9:.2f}B | {row['world_size']} | {row['logra_state_bytes'] / 2**30:.3f} | "
                     f"{accumulator / 2**30:.3f} | {local / 2**30:.3f} | "
                     f"{row['reference_bytes'] / 2**30:.3f} | {row['dense_adamw_bytes'] / 2**30:.2f} |")
    return "\n".join(lines)


def render_two_ranks(result: dict) -> list[str]:
    if "two_ranks" not in result:
        return []
    two = result["two_ranks"]
    rows = {(row["mode"], row["rank"]): row for row in two["rows"]}
    single = {row["mode"]: row["training_memory_mib"]
              for row in next(r for r in result["runs"] if r["logprob_chunk"] == result["library_logprob_chunk"])["modes"]}
    lines = ["### 2 processes (gloo, FSDP2 over both), the same step on each rank", "",
             "| mode | peak MiB rank 0 / 1 | one process | after build (sharded weights) | peak before optimizer / probe "
             "| sketch accumulator MiB | sketch MB sent per rank per step | loopback MB per step (both ranks, all traffic) | step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in RANK_MODES:
        pair = [rows[(mode, rank)] for rank in range(2)]
        first = pair[0]
        sketch = f"{first['sketch_buffer_mib']:,.0f} (+{first['scratch_mib']:,.0f} scratch)" if "sketch_buffer_mib" in first else "-"
        sent = f"{first['sketch_bytes_sent'] / 1e6:,.1f}" if "sketch_bytes_sent" in first else "-"
        lines.append(f"| {mode} | {pair[0]['peak_mib']:,.0f} / {pair[1]['peak_mib']:,.0f} | {single[mode.split('_')[0]]:,.0f} | "
                     f"{first['after_build_mib']:,.0f} | {first['peak_after_mib']['forward_backward']:,.0f} | {sketch} | {sent} | "
                     f"{first['loopback_bytes_step'] / 1e6:,.0f} | {first['step_seconds']:.1f} |")
    peak = {mode: max(rows[(mode, rank)]["peak_mib"] for rank in range(2)) for mode in RANK_MODES}
    lines += ["", f"Largest rank: LoGRA (sharded) / dense AdamW = **{peak['logra_sharded'] / peak['dense']:.3f}**, "
                  f"/ LoRA = {peak['logra_sharded'] / peak['lora']:.3f}; sharded / local accumulation = "
                  f"{peak['logra_sharded'] / peak['logra_local']:.3f}.",
              f"{machine_line(two['machine'])}; command: `{two['command']}`."
              + (f" Step: {step_line(two)}" if step_line(two) != step_line(result) else ""), ""]
    return lines


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    parts = ("weights", "gradients", "optimizer_state", "logra_state", "activations_and_temporaries")
    run = next(r for r in result["runs"] if r["logprob_chunk"] == result["library_logprob_chunk"])
    rows = {row["mode"]: row for row in run["modes"]}
    two = result.get("two_ranks")
    figure, axes = plt.subplots(1, 3 if two else 2, figsize=(18 if two else 12, 4.2))
    measured, analytic = axes[0], axes[-1]
    stacked_bars(measured, list(MODES), {part.replace("_", " "): [rows[mode]["breakdown_mib"][part] / 1024 for mode in MODES]
                                         for part in parts})
    measured.set_ylabel("GiB (peak RSS above the pre-model baseline)")
    measured.set_title(f"One RL step, {'tiny (smoke)' if result.get('smoke') else '156M'} Qwen2, "
                       f"{result['micro_batches']} x {result['tokens_per_micro_batch']} tokens\n"
                       f"{cpu_caption(result['machine'])}, {result['command']}", fontsize=9)
    if two:
        per_rank = axes[1]
        peaks = {(row["mode"], row["rank"]): row["peak_mib"] / 1024 for row in two["rows"]}
        for rank in range(2):
            per_rank.bar([i + (rank - 0.5) * 0.4 for i in range(len(RANK_MODES))], [peaks[(m, rank)] for m in RANK_MODES], 0.4,
                         label=f"rank {rank}")
        per_rank.set_xticks(range(len(RANK_MODES)), [m.replace("_", "\n") for m in RANK_MODES], fontsize=8)
        per_rank.set_ylabel("GiB per rank (peak RSS above the pre-model baseline)")
        per_rank.set_title(f"The same step on 2 gloo processes, FSDP2\n{cpu_caption(two['machine'])}, {two['command']}",
                           fontsize=9)
    names = [name for name in QWEN_SHAPES if any(r["model"] == name for r in result["analytic"])]
    width = 0.2
    bars = [("logra_state_bytes", 1, "LoGRA state, 1 rank"), ("logra_state_bytes", 8, "LoGRA state per rank, 8 ranks"),
            ("reference_bytes", 8, "reference layout per rank"), ("dense_adamw_bytes", 8, "dense AdamW grad + moments per rank, 8 ranks")]
    for offset, (key, world, label) in enumerate(bars):
        values = [next(r[key] for r in result["analytic"] if r["model"] == n and r["world_size"] == world) / 2**30 for n in names]
        analytic.bar([i + (offset - 1.5) * width for i in range(len(names))], values, width, label=label)
    analytic.set_yscale("log")
    analytic.set_xticks(range(len(names)), names, fontsize=8)
    analytic.set_ylabel("GiB per rank (log scale)")
    analytic.set_title("Analytic optimizer-side state, rank 256 (meta device)", fontsize=9)
    save_figure(figure, path)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process and print its JSON")
    parser.add_argument("--logprob-chunks", default=None,
                        help="comma-separated log-prob chunk sizes to measure (default: the library default, then 1024; smoke: the default)")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold")
    parser.add_argument("--world", type=int, choices=(2,), help="measure the 2-process rows and add them to memory.json")
    parser.add_argument("--smoke", action="store_true", help="the tiny model (model_shapes.SMOKE): checks the code paths, measures nothing")
    args = parser.parse_args()
    from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE

    if args.mode:
        print(json.dumps(run_mode(args.mode, int(args.logprob_chunks or DEFAULT_CHUNK_SIZE), args.smoke)))
        return
    check_smoke_out(parser, args)
    stem = args.out / "memory"
    if args.render:
        result = load_json(args.render)
    elif args.world:
        if not stem.with_suffix(".json").exists():
            parser.error(f"--world 2 adds to {stem}.json: measure the single-process rows first")
        result = load_json(stem.with_suffix(".json"))
        tokens = result["tokens_per_micro_batch"]
        rows = measure_ranks(_environment(args), tokens, result["micro_batches"], args.world, smoke=args.smoke)
        result["two_ranks"] = {"command": command_line("memory"), "machine": machine_info(), "code": code_version(),
                               "step": step_description(tokens, args.world), "rows": rows}
        result["analytic"] = analytic_rows(args.smoke)  # memory_report changed with sharded accumulation
        save_json(stem.with_suffix(".json"), result)
    else:
        result = measure(args, DEFAULT_CHUNK_SIZE)
        save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


def step_description(tokens: int, world: int = 1) -> str:
    prompt = prompt_share(tokens)
    where = "on each rank, its own rows" if world > 1 else "in each mode's process"
    return (f"GRPOModule's step on replayed rollouts ({MICRO_BATCHES} rows of {prompt} prompt + {tokens - prompt} completion "
            f"tokens, one prompt, {where}): `rl.step.run_update`: `backward_micro_batches`, one row per micro-batch, loss `grpo`, then "
            f"`AdamW.step()` or `LoGRAOptimizer.step` (probe on both rows).")


def analytic_rows(smoke: bool) -> list[dict]:
    return meta_memory_rows(("Qwen2.5-1.5B",) if smoke else None)


def measure(args, default_chunk: int) -> dict:
    if args.logprob_chunks:
        chunks = [int(c) for c in args.logprob_chunks.split(",")]
    else:
        chunks = [default_chunk] if args.smoke else [default_chunk, 1024]
    environment = _environment(args)
    runs = []
    for chunk in dict.fromkeys(chunks):
        modes = []
        for mode in MODES:
            completed = run_module("memory", ["--mode", mode, "--logprob-chunks", str(chunk), *(["--smoke"] if args.smoke else [])],
                                   capture_output=True, text=True, env=environment)
            if completed.returncode != 0:
                raise SystemExit(f"mode {mode} (chunk {chunk}) failed:\n{completed.stderr[-3000:]}")
            modes.append(json.loads(completed.stdout.strip().splitlines()[-1]))
            print(f"chunk {chunk} {mode}: {modes[-1]['training_memory_mib']:,.0f} MiB", flush=True)
        runs.append({"logprob_chunk": chunk, "modes": modes})
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    return {
        "benchmark": "training memory of one RL step (rollout excluded), each mode in a fresh process",
        "command": command_line("memory"),
        "machine": machine_info(),
        "code": code_version(),
        "allocator": "glibc default" if args.glibc_default else "glibc, MALLOC_MMAP_THRESHOLD_=65536",
        "smoke": args.smoke,
        "model": SMOKE if args.smoke else BENCH_156M, "tokens_per_micro_batch": tokens, "micro_batches": MICRO_BATCHES,
        "rank": RANK, "library_logprob_chunk": default_chunk,
        "step": step_description(tokens),
        "runs": runs,
        "analytic": analytic_rows(args.smoke),
    }


def _environment(args) -> dict:
    environment = dict(os.environ)
    if not args.glibc_default:
        environment["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if args.smoke:  # a tiny model's many small ops run fastest on one thread
        environment["OMP_NUM_THREADS"] = "1"
    return environment


if __name__ == "__main__":
    main()
