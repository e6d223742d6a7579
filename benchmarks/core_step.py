"""By-hand CPU micro-benchmark of one LoGRA step against one dense AdamW step.

One "step" = forward + backward over several micro-batches, then the update:

* LoGRA: ``LoGRAOptimizer(model)`` with the default config (rank 256, Rademacher,
  bf16 update factor); ``prepare_update(normalization_tokens=N)`` then
  ``apply_update(alpha=1.0)``, timed apart (no KL probe: not the library's one-call
  ``step``, whose pieces this benchmark times separately).
* dense: ``torch.optim.AdamW`` (fp32) over the same target weights, which require grad;
  ``step()`` then ``zero_grad(set_to_none=True)``.

The model is chosen before measuring: a stack of pre-norm SwiGLU MLP blocks whose Linear
layers carry LoGRA target names (``mlp.gate_proj``/``mlp.up_proj``: hidden -> inter,
``mlp.down_proj``: inter -> hidden, no bias) with residual connections and a parameter-free
RMS norm, float32. Both modes get an identical copy (same initial weights, same inputs) and
run in ONE process, alternating LoGRA / dense / LoGRA / dense ..., with warm-up pairs first;
every piece (forward, backward, prepare_update, step) is timed with ``perf_counter`` (CPU
ops are synchronous; the ``step`` piece is ``apply_update``). Reported: medians over the measured repetitions, all samples, and
the ratio median(LoGRA) / median(dense).

Second part: ``lightning_logra.memory_report`` for the Qwen2.5-1.5B and 7B shapes (built on
the meta device) at world sizes 1 and 8, next to the reference's replicated float32 layout
and dense AdamW.

    python benchmarks/core_step.py            # full run (~8 min on 2 cores)
    python benchmarks/core_step.py --quick    # smoke test, small shapes (~20 s)
    python benchmarks/core_step.py --profile  # also write torch.profiler tables
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_logra import LoGRAConfig, LoGRAOptimizer

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, machine_line, meta_memory_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PIECES = ("forward", "backward", "prepare_update", "step")
MODES = ("logra", "dense")
QUIET_CORES = 0.25  # a pair counts as quiet when other processes used fewer cores than this


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    blocks: int
    micro_batches: int
    tokens: int  # per micro-batch

    @property
    def target_parameters(self) -> int:
        return self.blocks * 3 * self.hidden * self.intermediate


FULL_SHAPES = (
    Shape("h1024", hidden=1024, intermediate=4096, blocks=4, micro_batches=4, tokens=2048),
    Shape("h2048", hidden=2048, intermediate=8192, blocks=2, micro_batches=2, tokens=2048),
)
QUICK_SHAPES = (Shape("quick-h512", hidden=512, intermediate=2048, blocks=2, micro_batches=2, tokens=512),)


class RMSNorm(nn.Module):
    """Parameter-free RMS norm (keeps the residual stream bounded; nothing to train)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = RMSNorm()
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MLPStack(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(shape.hidden, shape.intermediate) for _ in range(shape.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def gemm_flops(shape: Shape, rank: int = 256) -> dict[str, dict[str, float]]:
    """Matrix-multiply FLOPs of one step (2 per multiply-add), by piece and mode.

    dense: forward X W^T; backward dW = dY^T X and dX = dY W (no dX for the first block's
    gate/up: the model input needs no grad). LoGRA: the same forward plus P = X A^T, the same
    dX plus S += dY^T P, and in the update D A (applied) and the float64 Gram route to
    ||D A||. Elementwise work (activations, norms, AdamW, RowAdam) is not counted.
    """
    t, h, i = shape.tokens, shape.hidden, shape.intermediate
    layers = [(i, h), (i, h), (h, i)]  # (out d, in k): gate, up, down
    out = {mode: dict.fromkeys(PIECES, 0.0) for mode in MODES}
    for block in range(shape.blocks):
        for index, (d, k) in enumerate(layers):
            weight = 2.0 * t * d * k * shape.micro_batches
            input_grad = 0.0 if (block == 0 and index < 2) else weight
            out["dense"]["forward"] += weight
            out["dense"]["backward"] += weight + input_grad
            out["logra"]["forward"] += weight + 2.0 * t * k * rank * shape.micro_batches
            out["logra"]["backward"] += input_grad + 2.0 * t * d * rank * shape.micro_batches
            out["logra"]["step"] += 2.0 * d * rank * k
            out["logra"]["prepare_update"] += 2.0 * rank * rank * k + 2.0 * d * rank * rank
    for mode in MODES:
        out[mode]["total"] = sum(out[mode][p] for p in PIECES)
    return out


def loss_fn(output: torch.Tensor, total_tokens: int) -> torch.Tensor:
    # Sum over this micro-batch, normalised by the step's token count (as an RL loss is).
    return output.pow(2).sum() / (total_tokens * output.shape[-1])


# --------------------------------------------------------------------------- the runners
class Runner:
    """One mode's model, inputs and optimizer; the pieces of a step are timed separately."""

    mode = ""

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], total_tokens: int) -> None:
        self.model = model
        self.inputs = inputs
        self.total_tokens = total_tokens

    def micro_batch(self, index: int, times: dict[str, float]) -> None:
        t0 = time.perf_counter()
        loss = loss_fn(self.model(self.inputs[index]), self.total_tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        times["forward"] += t1 - t0
        times["backward"] += t2 - t1

    def update(self, times: dict[str, float]) -> None:
        raise NotImplementedError

    def run(self, micro_batches: int | None = None) -> dict[str, float]:
        """One whole step of this mode alone."""
        times = dict.fromkeys(PIECES, 0.0)
        for index in range(micro_batches or len(self.inputs)):
            self.micro_batch(index, times)
        self.update(times)
        return times


class LoGRARunner(Runner):
    mode = "logra"

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], total_tokens: int) -> None:
        super().__init__(model, inputs, total_tokens)
        self.optimizer = LoGRAOptimizer(model, LoGRAConfig())

    def update(self, times: dict[str, float]) -> None:
        t0 = time.perf_counter()
        self.optimizer.prepare_update(normalization_tokens=self.total_tokens)
        t1 = time.perf_counter()
        self.optimizer.apply_update(alpha=1.0)
        t2 = time.perf_counter()
        times["prepare_update"] += t1 - t0
        times["step"] += t2 - t1


class DenseRunner(Runner):
    mode = "dense"

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], total_tokens: int) -> None:
        super().__init__(model, inputs, total_tokens)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95))

    def update(self, times: dict[str, float]) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["step"] += time.perf_counter() - t0


def run_pair(runners: dict[str, Runner], interleave: str) -> dict[str, dict[str, float]]:
    """One step of each mode. ``step``: LoGRA's whole step, then dense's whole step.
    ``micro-batch``: LoGRA mb 0, dense mb 0, LoGRA mb 1, dense mb 1, ..., LoGRA update,
    dense update (each model's own sequence of work is unchanged; only the two are
    interleaved more finely, so that load from other processes hits both alike)."""
    times = {mode: dict.fromkeys(PIECES, 0.0) for mode in MODES}
    if interleave == "step":
        for mode in MODES:
            times[mode] = runners[mode].run()
        return times
    for index in range(len(runners[MODES[0]].inputs)):
        for mode in MODES:
            runners[mode].micro_batch(index, times[mode])
    for mode in MODES:
        runners[mode].update(times[mode])
    return times


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (all processes), or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def build(shape: Shape, seed: int = 0) -> tuple[LoGRARunner, DenseRunner]:
    torch.manual_seed(seed)
    base = MLPStack(shape)
    inputs = [torch.randn(1, shape.tokens, shape.hidden) for _ in range(shape.micro_batches)]
    total = shape.tokens * shape.micro_batches
    return LoGRARunner(copy.deepcopy(base), inputs, total), DenseRunner(copy.deepcopy(base), inputs, total)


def snapshot(runner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in runner.model.parameters()]


def check_runners(logra: LoGRARunner, dense: DenseRunner, logra_before, dense_before) -> dict:
    """Sanity after the warm-up: LoGRA formed no dense weight gradient, both models moved."""
    return {
        "logra_weight_grad_is_none": all(p.grad is None for p in logra.model.parameters()),
        "logra_weights_changed": all(not torch.equal(a, p) for a, p in zip(logra_before, logra.model.parameters())),
        "dense_weights_changed": all(not torch.equal(a, p) for a, p in zip(dense_before, dense.model.parameters())),
        "logra_update_count": logra.optimizer.update_count,
    }


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    out = {piece: statistics.median(s[piece] for s in samples) for piece in PIECES}
    out["total"] = statistics.median(sum(s[p] for p in PIECES) for s in samples)
    return out


def bench_shape(shape: Shape, warmup: int, reps: int, interleave: str, log) -> dict:
    logra, dense = build(shape)
    runners = {"logra": logra, "dense": dense}
    log(f"[{shape.name}] warm-up: {warmup} LoGRA/dense pair(s) of one micro-batch + update each")
    before = {"logra": snapshot(logra), "dense": snapshot(dense)}
    for _ in range(max(warmup, 1)):
        for mode in MODES:
            runners[mode].run(micro_batches=1)
    sanity = check_runners(logra, dense, before["logra"], before["dense"])
    del before
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    contention = []
    for rep in range(reps):
        gc.collect()
        cpu0, busy0, wall0 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
        pair = run_pair(runners, interleave)
        cpu1, busy1, wall1 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
        others = None if busy0 is None else max(busy1 - busy0 - (cpu1 - cpu0), 0.0)
        contention.append({
            "pair_wall_s": wall1 - wall0,
            "own_cpu_s": cpu1 - cpu0,
            "other_processes_cpu_s": others,
            "other_processes_cores": None if others is None else others / (wall1 - wall0),
            "load_average_1min": os.getloadavg()[0],
        })
        for mode in MODES:
            samples[mode].append(pair[mode])
            log(f"[{shape.name}] rep {rep + 1}/{reps} {mode:5s} total {sum(pair[mode][p] for p in PIECES):7.3f} s  "
                + "  ".join(f"{p} {pair[mode][p]:.3f}" for p in PIECES))
        if others is not None:
            log(f"[{shape.name}] rep {rep + 1}/{reps} other processes used {others / (wall1 - wall0):.2f} cores on average")
    medians = {mode: summarize(samples[mode]) for mode in MODES}
    # Secondary figure: the pairs during which other processes used < QUIET_CORES cores.
    quiet = [i for i, c in enumerate(contention) if c["other_processes_cores"] is not None and c["other_processes_cores"] < QUIET_CORES]
    quiet_ratio = None
    if len(quiet) >= 2:
        quiet_ratio = (statistics.median(sum(samples["logra"][i][p] for p in PIECES) for i in quiet)
                       / statistics.median(sum(samples["dense"][i][p] for p in PIECES) for i in quiet))
    paired = [sum(a[p] for p in PIECES) / sum(b[p] for p in PIECES) for a, b in zip(samples["logra"], samples["dense"])]
    k_min = min(shape.hidden, shape.intermediate)
    result = {
        "shape": asdict(shape) | {
            "description": f"{shape.blocks} x [x + down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x)))], "
            f"gate/up {shape.hidden}->{shape.intermediate}, down {shape.intermediate}->{shape.hidden}, "
            f"no bias, float32; {shape.micro_batches} micro-batches of {shape.tokens} tokens",
            "target_parameters": shape.target_parameters,
            "target_layers": shape.blocks * 3,
            "min_in_or_out_features": k_min,
        },
        "sanity": sanity,
        "gemm_flops": (flops := gemm_flops(shape)),
        "gemm_flop_ratio": flops["logra"]["total"] / flops["dense"]["total"],
        "interleave": interleave,
        "contention": contention,
        "medians_s": medians,
        "samples_s": samples,
        "ratio_logra_over_dense": medians["logra"]["total"] / medians["dense"]["total"],
        "paired_ratios": paired,
        "median_paired_ratio": statistics.median(paired),
        "quiet_pairs": quiet,
        "quiet_ratio_logra_over_dense": quiet_ratio,
        "target_ratio": 0.85,
        "meets_target": medians["logra"]["total"] / medians["dense"]["total"] <= 0.85,
    }
    log(f"[{shape.name}] median total LoGRA {medians['logra']['total']:.3f} s, dense {medians['dense']['total']:.3f} s, "
        f"ratio {result['ratio_logra_over_dense']:.3f}")
    return result, runners


def profile_shape(shape: Shape, runners: dict, log) -> dict[str, str]:
    """One step of each mode under torch.profiler; the op tables go to results/."""
    from torch.profiler import ProfilerActivity, profile

    files = {}
    for mode in MODES:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            runners[mode].run()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        shapes = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25)
        path = RESULTS / f"core_step_profile_{shape.name}_{mode}.txt"
        path.write_text(f"# {shape.name} {mode}: one step under torch.profiler (CPU)\n\n{table}\n\n# grouped by input shape\n\n{shapes}\n")
        files[mode] = str(path.relative_to(RESULTS.parent.parent))
        log(f"[{shape.name}] profile of {mode} written to {path}")
    return files


# --------------------------------------------------------------------------- output
def code_version() -> dict:
    """The commit the core was loaded from, and whether lightning_logra/ had local edits."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_logra"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
        return {"git_commit": commit, "lightning_logra_locally_modified": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "lightning_logra_locally_modified": None}


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
              f"script runtime {result['runtime_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_memory = bool(result.get("memory"))
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(13 if has_memory else 6, 4.6),
                             gridspec_kw={"width_ratios": [1, 1.5]} if has_memory else None)
    ax = axes[0] if has_memory else axes
    colors = {"forward": "#4C72B0", "backward": "#DD8452", "prepare_update": "#55A868", "step": "#C44E52"}
    labels, bottoms, x = [], [], 0
    for row in result["timing"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            bottom = 0.0
            for piece in PIECES:
                ax.bar(x, m[piece], bottom=bottom, color=colors[piece], label=piece if x == 0 else None, width=0.7)
                bottom += m[piece]
            labels.append(f"{row['shape']['name']}\n{mode}")
            bottoms.append(bottom)
            x += 1
        ax.text(x - 1.5, max(bottoms[-2:]) * 1.02, f"ratio {row['ratio_logra_over_dense']:.2f}", ha="center", fontsize=9)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("one step on CPU: LoGRA (rank 256) vs dense AdamW", fontsize=10)
    ax.set_ylim(0, max(bottoms) * 1.12)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    if has_memory:
        tab = axes[1]
        tab.axis("off")
        header = ["model", "world", "LoGRA\nstate", "reference\nfp32 S+A", "dense AdamW\ngrad+m+v"]
        cells = [[r["model"], str(r["world_size"]), f"{gib(r['logra_state_bytes']):.2f}",
                  f"{gib(r['reference_bytes']):.2f}", f"{gib(r['dense_adamw_bytes']):.2f}"] for r in result["memory"]]
        table = tab.table(cellText=cells, colLabels=header, loc="center", cellLoc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(9)
        table.scale(1, 1.9)
        tab.set_title("optimizer-side memory per rank (GiB), target weights only", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions: a smoke test")
    parser.add_argument("--reps", type=int, default=None, help="measured repetitions per mode (default 5; quick: 2)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up LoGRA/dense pairs (default 1)")
    parser.add_argument("--interleave", choices=("micro-batch", "step"), default="micro-batch",
                        help="A/B alternation granularity (default micro-batch: LoGRA mb, dense mb, ..., both updates)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's default, all cores)")
    parser.add_argument("--shapes", nargs="*", default=None, help="subset of shape names to run (default: all)")
    parser.add_argument("--profile", action="store_true", help="write torch.profiler op tables per shape and mode")
    parser.add_argument("--no-memory", action="store_true", help="skip the Qwen2.5 memory report")
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="measure nothing: rewrite the .md table and .png of an existing result JSON")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/core_step.json; quick: core_step_quick.json)")
    args = parser.parse_args(argv)

    if args.render:
        result = json.loads(args.render.read_text())
        plot(result, args.render.with_suffix(".png"))
        args.render.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    reps = args.reps or (2 if args.quick else 5)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    if args.shapes:
        shapes = tuple(s for s in shapes if s.name in args.shapes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / ("core_step_quick.json" if args.quick else "core_step.json")

    def log(message: str) -> None:
        print(f"{time.perf_counter() - start:7.1f}s  {message}", flush=True)

    result: dict = {
        "benchmark": "one training step: forward+backward over micro-batches + update; LoGRA vs dense AdamW",
        "machine": machine_info(),
        "code": code_version(),
        "logra_config": LoGRAConfig().to_dict(),
        "dense_optimizer": "torch.optim.AdamW(lr=1e-6, betas=(0.9, 0.95)), fp32, zero_grad(set_to_none=True) after step",
        "quick": args.quick,
        "warmup": args.warmup,
        "warmup_unit": "one micro-batch + update per mode",
        "repetitions": reps,
        "order": f"alternating LoGRA, dense, LoGRA, dense, ... in one process (granularity: {args.interleave})",
        "timing": [],
    }
    log(machine_line(result["machine"]))
    for shape in shapes:
        row, runners = bench_shape(shape, args.warmup, reps, args.interleave, log)
        if args.profile:
            row["profile_files"] = profile_shape(shape, runners, log)
        result["timing"].append(row)
        del runners
        gc.collect()
    if not args.no_memory:
        log("memory report for Qwen2.5-1.5B / 7B on the meta device")
        result["memory"] = meta_memory_rows(("Qwen2.5-1.5B", "Qwen2.5-7B"))
    result["runtime_s"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    plot(result, png)
    print()
    print(table)
    log(f"wrote {out}, {png} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
