"""The benchmarks' one harness: the replayed RL step of each mode, the modes side by side,
their summaries, the machine, and the outputs every script writes.

**The step is the library's own.** ``replay_rollouts`` builds a rollout batch once, with a
fixed generator: prompt and completion token ids (each group of ``num_generations`` rows
shares its prompt), completion masks, the rollout log-probs (the initial weights' own, as
the HF engine reports them, so the rollout/trainer mismatch starts at zero) and GRPO
advantages of random rewards (``group_advantages``). ``Runner.step`` replays it: the
micro-batched forward/backward ``GRPOModule`` runs per optimizer step
(``rl.batch.backward_micro_batches``: chunked token log-probs, the default ``LossConfig()``
loss, grpo, and its weighting), then the update: ``torch.optim.AdamW.step()`` as
``GRPOModule.configure_optimizers`` builds it (dense, LoRA) or ``LoGRAOptimizer.step``
with the batch's probe rows and log-prob pairs, as the ``logra_fsdp`` strategy calls it.
Every mode replays the same rollouts from the same initial weights.

**Side by side.** ``alternate_modes`` runs one untimed warm-up step per mode, then
repetitions that run every mode's step once, in an order that rotates by one each
repetition, so drift and order effects fall on every mode alike. Around each step it reads
how many cores other processes used (psutil's system busy time minus this process's CPU
time) and the 1-minute load. ``summarise`` gives per-piece medians, LoGRA's ratios to the
other modes (with and without its KL probe), the paired per-repetition ratios, and the
ratio over "quiet" repetitions (other processes below ``QUIET_CORES`` during every step).

Nothing here patches the library: LoGRA's probe time and its profiler ranges
(``logra.prepare`` / ``logra.probe`` / ``logra.apply``) come from ``LoGRAOptimizer.step``
itself, its state's size from ``LoGRAOptimizer.state_bytes()``, AdamW's from its state
tensors (``adamw_state_bytes``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .model_shapes import QWEN_SHAPES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("dense", "lora", "logra")
RANK = 256  # LoRA and LoGRA rank
# A flat KL budget (kl_budget = kl_budget_final), so alpha = min(3, sqrt(2e-4 / prediction))
# at every step, warm-up and repetitions alike, as when the scripts scaled the step by hand.
KL_BUDGET = 2e-4
QUIET_CORES = 0.25  # a repetition is quiet when other processes used fewer cores than this in every step
# Profiler ranges around the pieces of Runner.step (memory_ledger.py reads them).
RANGES = {"forward_backward": "bench.forward_backward", "backward": "bench.backward", "optimizer_step": "bench.optimizer_step"}
# The step every result written before this harness was measured with.
OLD_STEP = ("the benchmarks' own earlier RL step, not GRPOModule's (`common.Runner.step`, and memory_ledger.py's copy of "
            "it: a REINFORCE-shaped loss on random tokens, every position trained, one sequence per micro-batch, the KL "
            "probe on whole sequences); to be rerun with the harness's replayed GRPO step.")


# --- the replayed rollouts ------------------------------------------------------------------

@dataclass
class Replay:
    """A fixed rollout batch (``rl.batch.RolloutBatch``) and its group size."""

    batch: Any  # RolloutBatch
    num_generations: int

    @property
    def rows(self) -> int:
        return self.batch.rollouts.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        """Tokens per row (prompt + completion)."""
        return self.batch.rollouts.input_ids.shape[1]

    def describe(self) -> str:
        prompt = self.batch.rollouts.prompt_length
        return (f"{self.rows} rows ({self.rows // self.num_generations} prompts x {self.num_generations} generations) "
                f"of {prompt} prompt + {self.tokens - prompt} completion tokens")


def default_generations(rows: int) -> int:
    """Two prompts per batch when the rows split into two groups of at least 2 (so the
    probe's first two rows answer different prompts), else one group of every row."""
    if rows < 2:
        raise ValueError(f"GRPO needs at least 2 rows per batch (a group), got {rows}")
    return rows // 2 if rows >= 4 and rows % 2 == 0 else rows


def prompt_share(tokens: int) -> int:
    """Prompt tokens of a ``tokens``-long row: an eighth (at least 1), the rest completion."""
    return max(1, tokens // 8)


def random_token_rows(rows: int, prompt_tokens: int, completion_tokens: int, vocab_size: int, *,
                      num_generations: int, seed: int):
    """``rows x (prompt + completion)`` random token ids; each group of ``num_generations``
    consecutive rows shares its prompt, as GRPO's rollouts do."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (rows // num_generations, prompt_tokens), generator=generator)
    completions = torch.randint(0, vocab_size, (rows, completion_tokens), generator=generator)
    return torch.cat([prompts.repeat_interleave(num_generations, dim=0), completions], dim=1)


def replay_rollouts(model, input_ids, prompt_tokens: int, *, num_generations: int, seed: int, settings,
                    context: Callable[[], Any] = nullcontext) -> Replay:
    """The rollout batch of ``input_ids`` (``rows x T``, the first ``prompt_tokens`` of each
    row its prompt, the rest a completion that ended on EOS), scored once by ``model`` (no
    grad, the log-prob settings of ``settings``, a ``MicroBatching``) for the rollout
    log-probs, with GRPO advantages of rewards drawn from ``seed``."""
    import torch

    from lightning_logra.rl.batch import RolloutBatch
    from lightning_logra.rl.logprobs import sequence_logprobs
    from lightning_logra.rl.losses import group_advantages
    from lightning_logra.rollout.base import pack_rollouts

    device = next(model.parameters()).device
    ids = input_ids.to(device)
    with torch.no_grad(), context():
        scored = torch.cat([
            sequence_logprobs(model, ids[start:start + settings.micro_batch_size],
                              torch.ones_like(ids[start:start + settings.micro_batch_size]),
                              temperature=settings.temperature, chunk_size=settings.chunk_size)
            for start in range(0, ids.shape[0], settings.micro_batch_size)
        ]).float().cpu()
    cpu_ids = input_ids.cpu()
    rows = cpu_ids.shape[0]
    rollouts = pack_rollouts(
        prompt_ids=cpu_ids[:, :prompt_tokens].tolist(), completion_ids=cpu_ids[:, prompt_tokens:].tolist(),
        completion_logprobs=scored[:, prompt_tokens - 1:].tolist(), completion_text=[""] * rows,
        ended_with_eos=[True] * rows, pad_token_id=0, device=device)
    rewards = torch.randn(rows, generator=torch.Generator().manual_seed(seed))
    advantages = group_advantages(rewards, num_generations, normalize_std=settings.loss.type != "dr_grpo").to(device)
    mask = rollouts.completion_mask[:, 1:].bool()  # log-prob t scores token t + 1
    return Replay(RolloutBatch(rollouts, mask, rollouts.rollout_logprobs[:, 1:], advantages), num_generations)


def micro_batching(completion_tokens: int, *, micro_batch_size: int = 1, logprob_chunk: int | None = None):
    """GRPOModule's defaults (loss ``LossConfig()``: grpo; sampling temperature 1; no
    truncated importance sampling, as with the HF engine) but for the micro-batch size and
    the log-prob chunk, which each benchmark sets."""
    from lightning_logra.rl.batch import MicroBatching
    from lightning_logra.rl.config import LossConfig
    from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE

    return MicroBatching(loss=LossConfig(), micro_batch_size=micro_batch_size, temperature=1.0,
                         chunk_size=logprob_chunk or DEFAULT_CHUNK_SIZE, max_completion_length=completion_tokens, tis=False)


# --- one mode, one step -----------------------------------------------------------------------

@dataclass(frozen=True)
class StepHooks:
    """What a device run wraps around the step; the defaults are a plain CPU step."""

    context: Callable[[], Any] = nullcontext  # around the forward/backward and LoGRA's step, e.g. bf16 autocast
    synchronize: Callable[[], None] = lambda: None  # before each clock read, e.g. torch.cuda.synchronize


class Clock:
    """Seconds between calls, with ``synchronize`` (the device's queue drained) first."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None):
        self.synchronize = synchronize
        self.last = self._now()

    def _now(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        seconds, self.last = now - self.last, now
        return seconds


class Runner:
    """One mode's model, optimizer (``torch.optim.AdamW`` or ``LoGRAOptimizer``) and
    micro-batching settings."""

    def __init__(self, mode: str, model, optimizer, settings, hooks: StepHooks = StepHooks()):
        self.mode, self.model, self.optimizer, self.settings, self.hooks = mode, model, optimizer, settings, hooks
        self.last_report = None  # LoGRA's StepReport of the last step

    @property
    def logra(self):
        """The LoGRA optimizer, None for dense and LoRA."""
        return self.optimizer if self.mode == "logra" else None

    def step(self, replay: Replay, rows: slice | None = None,
             phase: Callable[[str], None] = lambda name: None) -> dict[str, float]:
        """One optimizer step of GRPOModule on ``rows`` of the replayed batch (default: all):
        ``backward_micro_batches``, then the update. Returns its seconds by piece:
        ``forward_backward``, ``update``, ``kl_probe`` (LoGRA's ``StepReport.probe_s``; 0
        otherwise) and their sum ``step``. ``phase(name)`` is called as ``forward_backward``
        and ``update`` end, so the caller can read memory there. Profiler ranges
        ``RANGES`` mark the forward/backward, each backward and the optimizer step (LoGRA's
        own ``logra.prepare`` / ``logra.probe`` / ``logra.apply`` sit inside the last)."""
        import torch.distributed as dist
        from torch.profiler import record_function

        from lightning_logra.rl.batch import backward_micro_batches
        from lightning_logra.rl.metrics import PassTotals

        rows = rows or slice(0, replay.rows)
        batch, settings = replay.batch, self.settings
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        clock = Clock(self.hooks.synchronize)
        if self.logra is None:
            self.optimizer.zero_grad()  # as GRPOModule's update starts; LoGRA's step zeroes its sketches itself

        def backward(loss):
            with record_function(RANGES["backward"]):
                loss.backward()

        with self.hooks.context(), record_function(RANGES["forward_backward"]):
            trainer_logprobs = backward_micro_batches(self.model, batch, rows, settings, backward=backward,
                                                      passes=PassTotals.zeros(batch.mask.device), world=world)
        if trainer_logprobs is None:
            raise RuntimeError("the replayed rows have no completion token to train on")
        times = {"forward_backward": clock.lap(), "update": 0.0, "kl_probe": 0.0}
        phase("forward_backward")
        if self.logra is None:
            with record_function(RANGES["optimizer_step"]):
                self.optimizer.step()
            times["update"] = clock.lap()
        else:
            # A partial batch (the warm-up's first micro-batch) is probed in its own order.
            count = rows.stop - rows.start
            generations = replay.num_generations if count % replay.num_generations == 0 else 1
            with self.hooks.context(), record_function(RANGES["optimizer_step"]):
                report = self.logra.step(
                    probe=batch.probe_batch(rows, num_generations=generations, temperature=settings.temperature),
                    logprob_pairs=batch.logprob_pairs(rows, trainer_logprobs), normalization_tokens=1.0)
            seconds = clock.lap()
            if report.skipped:  # a skipped step changed nothing: its times measure nothing
                raise RuntimeError(f"LoGRA skipped the benchmark step: {report.skip_reason}")
            self.last_report = report
            # The report's clocks do not synchronize the device; the step's synchronized wall
            # time minus the probe is prepare_s + apply_s plus the work apply left queued.
            times["kl_probe"] = report.probe_s
            times["update"] = seconds - report.probe_s
        phase("update")
        times["step"] = sum(times.values())
        return times


def build_mode(mode: str, model, settings, *, probe_responses: int, probe_max_tokens: int, compute_dtype=None,
               hooks: StepHooks = StepHooks(), shard: Callable[[Any], None] | None = None, **logra_settings) -> Runner:
    """``model`` (a Hugging Face causal LM) trained as GRPOModule trains it in ``mode``:
    activation checkpointing on, then dense AdamW (every parameter), LoRA r=256 (the
    library's ``with_lora``: peft on the seven projections, AdamW over the adapters) or
    LoGRA r=256 (``LoGRAOptimizer``, which freezes everything else).

    AdamW: ``OptimizerConfig()``'s lr, betas and weight decay, as ``configure_optimizers``
    builds it (its warm-up schedule is left out: it changes the lr, not the work). LoGRA:
    the library's defaults but for a flat KL budget of ``KL_BUDGET`` and the probe's rows and
    length, which each benchmark sets: ``probe_responses`` rows of at most
    ``probe_max_tokens`` real tokens; ``logra_settings`` set other ``LoGRAConfig`` fields.
    ``compute_dtype``: LoGRA's projection dtype (bf16 under autocast). ``shard``: called on
    the (peft-wrapped) model before the optimizer is built, e.g. to FSDP2-shard it."""
    import torch

    from lightning_logra import LoGRAConfig, LoGRAOptimizer
    from lightning_logra.models import enable_activation_checkpointing, with_lora
    from lightning_logra.rl.config import LoRAConfig, OptimizerConfig

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    enable_activation_checkpointing(model)
    model.train()
    if mode == "lora":
        model = with_lora(model, LoRAConfig(rank=RANK, alpha=2.0 * RANK))
    if shard is not None:
        shard(model)
    if mode == "logra":
        config = LoGRAConfig(rank=RANK, kl_budget=KL_BUDGET, kl_budget_final=KL_BUDGET, probe_responses=probe_responses,
                             probe_max_tokens=probe_max_tokens, **logra_settings)
        optimizer = LoGRAOptimizer(model, config, compute_dtype=compute_dtype)
    else:
        adamw = OptimizerConfig()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=adamw.lr,
                                      betas=tuple(adamw.betas), weight_decay=adamw.weight_decay)
    return Runner(mode, model, optimizer, settings, hooks)


def adamw_state_bytes(optimizer) -> int:
    """Bytes of an AdamW's state tensors (the moments; the scalar step counters are not
    counted)."""
    import torch

    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def optimizer_state_bytes(runner: Runner) -> dict[str, int]:
    """The optimizer's state by part, in bytes, with its ``total``: LoGRA's from
    ``LoGRAOptimizer.state_bytes()``, AdamW's moments from ``adamw_state_bytes``."""
    if runner.logra is not None:
        return runner.logra.state_bytes()
    moments = adamw_state_bytes(runner.optimizer)
    return {"adamw_moments": moments, "total": moments}


# --- the modes side by side -------------------------------------------------------------------

def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (all processes), or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def timed_step(runner: Runner, replay: Replay) -> tuple[dict[str, float], dict]:
    """One step, and how many cores other processes used meanwhile."""
    gc.collect()
    cpu0, busy0, wall0 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
    times = runner.step(replay)
    cpu1, busy1, wall1 = time.process_time(), busy_cpu_seconds(), time.perf_counter()
    others = None if busy0 is None else max(busy1 - busy0 - (cpu1 - cpu0), 0.0) / (wall1 - wall0)
    return times, {"other_processes_cores": others, "load_average_1min": os.getloadavg()[0]}


def alternate_modes(runners: dict[str, Runner], replay: Replay, reps: int, label: str | None = None) -> dict:
    """Every runner's step ``reps`` times on the same replayed rollouts: an untimed warm-up
    (the first micro-batch and an update) per mode, then repetitions whose mode order
    rotates by one. Returns ``samples`` and ``contention`` (mode -> one entry per repetition)."""
    modes = tuple(runners)
    for mode in modes:  # first-call costs, not timed
        runners[mode].step(replay, rows=slice(0, runners[mode].settings.micro_batch_size))
    samples = {mode: [] for mode in modes}
    contention = {mode: [] for mode in modes}
    for rep in range(reps):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            times, load = timed_step(runners[mode], replay)
            samples[mode].append(times)
            contention[mode].append(load)
            if label:
                print(f"[{label}] rep {rep + 1}/{reps} {mode}: {times['step']:.1f} s", flush=True)
    return {"samples": samples, "contention": contention}


def summarise(samples: dict[str, list[dict]], contention: dict[str, list[dict]] | None = None) -> dict:
    """Every sample, the per-piece medians, LoGRA's ratios to dense and LoRA from them (with
    and without the probe), the probe's share of LoGRA's step, the paired per-repetition
    LoGRA / dense ratios and, with ``contention``, the ratio over quiet repetitions."""
    medians = {mode: {piece: statistics.median(s[piece] for s in runs) for piece in runs[0]} for mode, runs in samples.items()}
    out: dict[str, Any] = {"samples": samples, "medians_s": medians}
    logra = medians.get("logra")
    if logra is None:
        return out
    without_probe = logra["step"] - logra["kl_probe"]
    for base in ("dense", "lora"):
        if base in medians:
            out[f"logra_over_{base}"] = logra["step"] / medians[base]["step"]
            out[f"logra_over_{base}_without_probe"] = without_probe / medians[base]["step"]
    out["probe_share_of_logra_step"] = logra["kl_probe"] / logra["step"]
    if "dense" in samples:
        paired = [l["step"] / d["step"] for l, d in zip(samples["logra"], samples["dense"])]
        out["paired_logra_over_dense"] = paired
        out["median_paired_logra_over_dense"] = statistics.median(paired)
    if contention:
        out["contention"] = contention
        reps = len(samples["logra"])
        quiet = [rep for rep in range(reps) if all(
            loads[rep]["other_processes_cores"] is not None and loads[rep]["other_processes_cores"] < QUIET_CORES
            for loads in contention.values())]
        out["quiet_repetitions"] = quiet
        if len(quiet) >= 2 and "dense" in samples:
            out["quiet_logra_over_dense"] = (statistics.median(samples["logra"][rep]["step"] for rep in quiet)
                                             / statistics.median(samples["dense"][rep]["step"] for rep in quiet))
    return out


def contention_line(row: dict) -> str | None:
    """The paired ratios and other processes' load of a summarised row, None for rows
    measured before the harness recorded them."""
    if "contention" not in row:
        return None
    reps = len(row["paired_logra_over_dense"])
    loads = [max(loads[rep]["other_processes_cores"] or 0.0 for loads in row["contention"].values()) for rep in range(reps)]
    quiet = row.get("quiet_logra_over_dense")
    return (f"paired LoGRA / dense per repetition {', '.join(f'{r:.3f}' for r in row['paired_logra_over_dense'])} "
            f"(median {row['median_paired_logra_over_dense']:.3f}); other processes' cores per repetition (the most "
            f"during any mode's step) {', '.join(f'{x:.2f}' for x in loads)}; LoGRA / dense over the quiet repetitions "
            f"(< {QUIET_CORES} cores): " + (f"{quiet:.3f} ({len(row['quiet_repetitions'])})" if quiet is not None
                                             else f"n/a ({len(row['quiet_repetitions'])} quiet)"))


# --- the machine, the code, analytic rows -------------------------------------------------------

def machine_info() -> dict:
    """The machine a result was measured on: processor, cpus, torch, date_utc (what
    ``machine_line`` prints), and the details behind them."""
    import torch

    processor = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"processor": processor, "cpus": os.cpu_count(), "torch": torch.__version__,
            "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "platform": platform.platform(),
            "mkl": torch.backends.mkl.is_available()}
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def machine_line(machine: dict) -> str:
    """The machine as the results tables name it (also from results that named its fields
    cpu_model / logical_cpus / torch_version)."""
    processor = machine.get("processor", machine.get("cpu_model"))
    cpus = machine.get("cpus", machine.get("logical_cpus"))
    torch_version = machine.get("torch", machine.get("torch_version"))
    return f"Machine: {processor}, {cpus} CPUs, torch {torch_version}, {machine['date_utc']}"


def cpu_caption(machine: dict) -> str:
    """``CPU (N cores), YYYY-MM-DD`` for figure titles."""
    return f"CPU ({machine.get('cpus', machine.get('logical_cpus'))} cores), {machine['date_utc'][:10]}"


def code_version() -> dict:
    """The commit the library was loaded from, and whether lightning_logra/ had local edits."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_logra"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        return {"git_commit": commit, "lightning_logra_locally_modified": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "lightning_logra_locally_modified": None}


def code_line(code: dict | None) -> str:
    if not code:
        return ""
    return f"Code: commit {str(code.get('git_commit'))[:10]}{' + local edits' if code.get('lightning_logra_locally_modified') else ''}."


def step_line(entry: dict) -> str:
    """Which step a result (or a row of one) measured: its ``step`` field, or ``OLD_STEP``
    for results written before the harness."""
    return entry.get("step", OLD_STEP)


def meta_memory_rows(names=None, world_sizes=(1, 8)) -> list[dict]:
    """``memory_report`` of each ``model_shapes.QWEN_SHAPES`` entry in ``names`` (default:
    all), built on the meta device, at each world size: the model, its parameter count and
    the report's fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import memory_report

    rows = []
    for name in names or QWEN_SHAPES:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPES[name]))
        parameters = sum(p.numel() for p in model.parameters())
        for world in world_sizes:
            local = memory_report(model, world_size=world, sketch_accumulation="local")
            rows.append({"model": name, "parameters": parameters, **memory_report(model, world_size=world).as_dict(),
                         "logra_state_local_bytes": local.logra_state_bytes})
        del model
    return rows


# --- command line and outputs --------------------------------------------------------------------

def argument_parser(doc: str, render_help: str = "measure nothing: rewrite the .md (and .png) from a results file") -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, ``--render JSON`` and ``--out DIR``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", type=Path, metavar="JSON", help=render_help)
    parser.add_argument("--out", type=Path, default=RESULTS, metavar="DIR",
                        help="folder for the .json/.md/.png (default benchmarks/results)")
    return parser


def check_smoke_out(parser: argparse.ArgumentParser, args) -> None:
    """A ``--smoke`` run measures nothing: it must not overwrite the committed results."""
    if getattr(args, "smoke", False) and args.out.resolve() == RESULTS.resolve():
        parser.error("--smoke needs --out DIR: a smoke run must not overwrite benchmarks/results")


def command_line(module: str) -> str:
    """How this run was started, as the results record it."""
    return " ".join(["python", "-m", f"benchmarks.{module}", *sys.argv[1:]])


def run_module(module: str, arguments: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<module> <arguments>`` in a fresh process, from the
    repository root (where ``benchmarks`` and, uninstalled, ``lightning_logra`` import)."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *arguments], cwd=ROOT, **kwargs)


def save_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def write_outputs(stem: Path, result: dict, render: Callable[[dict], str], plot: Callable[[dict, Path], None] | None) -> None:
    """``stem``.md (the rendered tables) and ``stem``.png (where matplotlib is installed:
    the ``bench`` extra); the tables printed."""
    import importlib.util

    stem.parent.mkdir(parents=True, exist_ok=True)
    table = render(result)
    stem.with_suffix(".md").write_text(table + "\n")
    print(table)
    if plot is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): {stem.name}.png not drawn", file=sys.stderr)
        return
    plot(result, stem.with_suffix(".png"))


def stacked_bars(axis, labels: list[str], parts: dict[str, list[float]]) -> None:
    """One bar per label, stacked from ``parts`` (legend name -> one value per label)."""
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        axis.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]


def save_figure(figure, path: Path, title: str | None = None, legend_fontsize: int = 8) -> None:
    """A legend on every axis that labels something, the title (small), tight layout, PNG at 90 dpi."""
    import matplotlib.pyplot as plt

    for axis in figure.axes:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=legend_fontsize)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
