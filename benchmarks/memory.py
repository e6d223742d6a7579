"""Training memory of one RL step: dense AdamW vs LoRA r=256 vs LoGRA r=256.

Each mode runs in its own fresh process. One step = 2 micro-batches of 2,048 tokens
(forward with chunked, checkpointed token log-probs, a policy-gradient loss, backward with
activation checkpointing) then the optimizer step (``common.Runner.step``); for LoGRA the
library's ``LoGRAOptimizer.step``, with its KL probe on the two sequences. Rollout
generation is excluded. The model is fixed before measuring
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

The second part is analytic: LoGRA's per-rank state (``memory_report``) for Qwen2.5-1.5B,
7B, 14B and a 27B-class config at world sizes 1 and 8, built on the meta device, beside
the reference's replicated float32 layout and dense AdamW's gradient + moments.

    python benchmarks/memory.py    # writes results/memory.{json,md,png}
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (MODES, RANK, argument_parser, build_mode, cpu_caption, machine_info, machine_line,  # noqa: E402
                    meta_memory_rows, save_figure, save_json, stacked_bars, write_outputs)
from model_shapes import BENCH_156M, QWEN_SHAPES  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 2**20
TOKENS, MICRO_BATCHES = 2048, 2
TARGETS = {"dense": 0.40, "lora": 0.50}  # LoGRA / mode


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / MIB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def run_mode(mode: str, logprob_chunk: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, BENCH_156M["vocab_size"], (1, TOKENS), generator=generator) for _ in range(MICRO_BATCHES)]
    advantages = torch.randn(MICRO_BATCHES, generator=generator)
    baseline = rss_mib()

    # LoGRA probes both sequences at full length, as this benchmark always has (set explicitly).
    runner = build_mode(mode, Qwen2ForCausalLM(Qwen2Config(**BENCH_156M)), probe_responses=MICRO_BATCHES,
                        probe_max_tokens=TOKENS, logprob_chunk=logprob_chunk)
    model, logra = runner.model, runner.logra
    phases, gradients = {}, []

    def end_phase(name: str) -> None:
        if name == "forward_backward":  # the gradients exist until the optimizer step
            gradients.append(tensor_mib(p.grad for p in model.parameters() if p.grad is not None))
        if name != "update":
            phases[name] = peak_rss_mib() - baseline

    seconds = runner.step(batches, advantages, phase=end_phase)["step"]
    if logra is None:
        optimizer_state = tensor_mib(t for state in runner.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        logra_state = 0.0
    else:
        optimizer_state = 0.0
        logra_state = tensor_mib([logra.sketches.buffer] + [s.projection for s in logra.sketches] + [s.second_moment for s in logra.sketches])
    weights = tensor_mib(model.parameters())
    peak = peak_rss_mib() - baseline
    phases["step"] = peak
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)
        if logra is None else sum(s.weight.numel() for s in logra.sketches),
        "training_memory_mib": peak,
        "peak_after_mib": phases,
        "breakdown_mib": {
            "weights": weights,
            "gradients": gradients[0],
            "optimizer_state": optimizer_state,
            "logra_state": logra_state,
            "activations_and_temporaries": peak - weights - gradients[0] - optimizer_state - logra_state,
        },
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
        verdicts = []
        for mode, target in TARGETS.items():
            ratio = logra / rows[mode]["training_memory_mib"]
            verdicts.append(f"LoGRA / {'dense AdamW' if mode == 'dense' else 'LoRA-r256'} = **{ratio:.3f}** "
                            f"(target <= {target:.2f}: {'met' if ratio <= target else 'missed'})")
        probe = rows["logra"]["peak_after_mib"]
        lines += ["", "; ".join(verdicts) + ".",
                  f"LoGRA's peak before the KL probe was {probe['forward_backward']:,.0f} MiB, after it {probe['kl_probe']:,.0f} MiB.", ""]
    lines += [
        f"{machine_line(result['machine'])}, allocator: {result['allocator']}; "
        f"model {result['model']}; {MICRO_BATCHES} x {TOKENS} tokens, rank {RANK}, activation checkpointing in every mode.",
        "",
        "### Analytic per-rank state (meta device, `memory_report`, rank 256, bf16 compute)",
        "",
        "| model | parameters | world | LoGRA state GiB | reference layout GiB | dense AdamW grad + moments GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["analytic"]:
        lines.append(f"| {row['model']} | {row['parameters'] / 1e9:.2f}B | {row['world_size']} | {row['logra_state_bytes'] / 2**30:.3f} | "
                     f"{row['reference_bytes'] / 2**30:.3f} | {row['dense_adamw_bytes'] / 2**30:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ("weights", "gradients", "optimizer_state", "logra_state", "activations_and_temporaries")
    run = next(r for r in result["runs"] if r["logprob_chunk"] == result["library_logprob_chunk"])
    rows = {row["mode"]: row for row in run["modes"]}
    figure, (measured, analytic) = plt.subplots(1, 2, figsize=(12, 4.2))
    stacked_bars(measured, list(MODES), {part.replace("_", " "): [rows[mode]["breakdown_mib"][part] / 1024 for mode in MODES]
                                         for part in parts})
    measured.set_ylabel("GiB (peak RSS above the pre-model baseline)")
    measured.set_title(f"One RL step, 156M Qwen2, {MICRO_BATCHES} x {TOKENS} tokens\n"
                       f"{cpu_caption(result['machine'])}, python benchmarks/memory.py", fontsize=9)
    names = list(QWEN_SHAPES)
    width = 0.27
    for offset, (key, label) in enumerate([("logra_state_bytes", "LoGRA state"), ("reference_bytes", "reference layout"),
                                           ("dense_adamw_bytes", "dense AdamW grad + moments")]):
        values = [next(r[key] for r in result["analytic"] if r["model"] == n and r["world_size"] == 1) / 2**30 for n in names]
        analytic.bar([i + (offset - 1) * width for i in range(len(names))], values, width, label=label)
    analytic.set_yscale("log")
    analytic.set_xticks(range(len(names)), names, fontsize=8)
    analytic.set_ylabel("GiB per rank (world size 1, log scale)")
    analytic.set_title("Analytic optimizer-side state, rank 256 (meta device)", fontsize=9)
    save_figure(figure, path)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process and print its JSON")
    parser.add_argument("--logprob-chunks", default=None,
                        help="comma-separated log-prob chunk sizes to measure (default: the library default, then 1024)")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold")
    args = parser.parse_args()
    from lightning_logra.modules.logprobs import DEFAULT_CHUNK_SIZE

    if args.mode:
        print(json.dumps(run_mode(args.mode, int(args.logprob_chunks or DEFAULT_CHUNK_SIZE))))
        return
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        result = measure(args, DEFAULT_CHUNK_SIZE)
    write_outputs(RESULTS / "memory", result, render, plot)


def measure(args, default_chunk: int) -> dict:
    chunks = [int(c) for c in args.logprob_chunks.split(",")] if args.logprob_chunks else [default_chunk, 1024]
    environment = dict(os.environ)
    if not args.glibc_default:
        environment["MALLOC_MMAP_THRESHOLD_"] = "65536"
    runs = []
    for chunk in dict.fromkeys(chunks):
        modes = []
        for mode in MODES:
            completed = subprocess.run([sys.executable, __file__, "--mode", mode, "--logprob-chunks", str(chunk)],
                                       capture_output=True, text=True, env=environment)
            if completed.returncode != 0:
                raise SystemExit(f"mode {mode} (chunk {chunk}) failed:\n{completed.stderr[-3000:]}")
            modes.append(json.loads(completed.stdout.strip().splitlines()[-1]))
            print(f"chunk {chunk} {mode}: {modes[-1]['training_memory_mib']:,.0f} MiB", flush=True)
        runs.append({"logprob_chunk": chunk, "modes": modes})
    result = {
        "benchmark": "training memory of one RL step (rollout excluded), each mode in a fresh process",
        "command": " ".join(["python", "benchmarks/memory.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "allocator": "glibc default" if args.glibc_default else "glibc, MALLOC_MMAP_THRESHOLD_=65536",
        "model": BENCH_156M, "tokens_per_micro_batch": TOKENS, "micro_batches": MICRO_BATCHES, "rank": RANK,
        "library_logprob_chunk": default_chunk,
        "runs": runs,
        "analytic": meta_memory_rows(),
    }
    save_json(RESULTS / "memory.json", result)
    return result


if __name__ == "__main__":
    main()
