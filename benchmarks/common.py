"""What the step benchmarks share: building a mode, one RL step, the machine, meta-device rows.

``build_mode`` turns a model into one of the three compared modes (dense AdamW, LoRA r=256,
LoGRA r=256) and ``Runner.step`` runs one RL step of it: forward + backward over the
micro-batches, then the update, which for LoGRA is the library's own
``LoGRAOptimizer.step`` (prepare, budget, KL probe, scale, apply, skip logic). ``speed.py``,
``memory.py`` and ``gpu.py`` step through it; ``StepHooks`` and the ``phase`` callback add
what a GPU run needs (bf16 autocast, ``torch.cuda.synchronize`` before each clock read, the
peak memory of each phase). ``alternate_modes`` / ``summarise_samples`` time the modes side
by side; ``machine_info`` / ``machine_line`` describe the machine; ``meta_memory_rows`` are
the analytic ``memory_report`` rows of models built on the meta device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("dense", "lora", "logra")
RANK = 256  # LoRA and LoGRA rank
# The benchmarks scaled LoGRA's step to a fixed KL budget, alpha = kl_step_scale(prediction,
# budget=2e-4) (alpha_max 3), before the library's step existed. The library's step takes the
# budget from its cosine schedule (kl_budget -> kl_budget_final); a flat schedule at this
# value keeps every step's alpha what it was, warm-up and repetitions alike.
KL_BUDGET = 2e-4


# --- one mode, one RL step --------------------------------------------------------------

@dataclass(frozen=True)
class StepHooks:
    """What a device run wraps around the shared step; the defaults are a plain CPU step."""

    context: Callable[[], Any] = nullcontext  # around each forward and LoGRA's update, e.g. bf16 autocast
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
    """One mode's model and optimizer (``torch.optim.AdamW`` or ``LoGRAOptimizer``)."""

    def __init__(self, mode: str, model, optimizer, hooks: StepHooks, logprob_chunk: int | None):
        self.mode, self.model, self.optimizer, self.hooks, self.logprob_chunk = mode, model, optimizer, hooks, logprob_chunk

    @property
    def logra(self):
        """The LoGRA optimizer, None for dense and LoRA."""
        return self.optimizer if self.mode == "logra" else None

    def step(self, sequences: list, advantages, phase: Callable[[str], None] = lambda name: None) -> dict[str, float]:
        """One RL step: forward (token log-probs) + backward of a REINFORCE-shaped loss over
        ``sequences`` (one micro-batch each), then the update. Returns its seconds by piece:
        ``forward_backward``, ``update``, ``kl_probe`` (LoGRA only) and their sum ``step``.

        ``phase(name)`` is called as each phase ends, ``forward_backward``, ``kl_probe``
        (LoGRA only: prepare and probe) and ``update``, so the caller can read the memory
        of each phase there."""
        import torch

        from lightning_logra import ProbeBatch
        from lightning_logra.rl.logprobs import sequence_logprobs

        chunk = {} if self.logprob_chunk is None else {"chunk_size": self.logprob_chunk}
        times = {"forward_backward": 0.0, "update": 0.0, "kl_probe": 0.0}
        clock = Clock(self.hooks.synchronize)
        for sequence, advantage in zip(sequences, advantages):
            with self.hooks.context():
                logprobs = sequence_logprobs(self.model, sequence, torch.ones_like(sequence), **chunk)
            (-(advantage * logprobs).mean() / len(sequences)).backward()
        times["forward_backward"] = clock.lap()
        phase("forward_backward")
        if self.logra is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            times["update"] = clock.lap()
        else:
            # The library's step: prepare, KL budget, probe (the first probe_responses rows,
            # every position that predicts a real next token), scale, apply. Under the
            # context, as in GRPOModule, whose optimizer step runs inside its (autocast)
            # training step.
            probe = ProbeBatch.from_token_batch(torch.cat(sequences))
            with self.hooks.context(), _phase_after_probe(self.logra, phase):
                report = self.logra.step(probe=probe, normalization_tokens=sum(s.numel() for s in sequences))
            seconds = clock.lap()
            if report.skipped:  # a skipped step changed nothing: its times measure nothing
                raise RuntimeError(f"LoGRA skipped the benchmark step: {report.skip_reason}")
            # The report's clocks do not synchronize the device; the step's synchronized wall
            # time minus the probe is prepare_s + apply_s plus the work apply left queued.
            times["kl_probe"] = report.probe_s
            times["update"] = seconds - report.probe_s
        phase("update")
        times["step"] = sum(times.values())
        return times


@contextmanager
def _phase_after_probe(logra, phase: Callable[[str], None]) -> Iterator[None]:
    """Call ``phase("kl_probe")`` when LoGRA's step has predicted the KL, between its probe
    and its apply (the step is one call; its prediction is the one seam between the two)."""
    predict = logra.predict_kl

    def predict_then_end_phase(*args, **kwargs):
        prediction = predict(*args, **kwargs)
        phase("kl_probe")
        return prediction

    logra.predict_kl = predict_then_end_phase  # this instance only, for this step only
    try:
        yield
    finally:
        del logra.predict_kl


def build_mode(mode: str, model, *, probe_responses: int, probe_max_tokens: int, compute_dtype=None,
               hooks: StepHooks = StepHooks(), logprob_chunk: int | None = None,
               shard: Callable[[Any], None] | None = None, sketch_accumulation: str = "auto") -> Runner:
    """``model`` (a Hugging Face causal LM) trained as ``mode``: activation checkpointing on,
    then dense AdamW (every parameter), LoRA r=256 (peft, the seven projections, AdamW over
    the adapters) or LoGRA r=256 (``LoGRAOptimizer``, which freezes everything else).

    AdamW: lr 1e-6, betas (0.9, 0.95), fused on CUDA. LoGRA: the library's defaults but for
    a flat KL budget of ``KL_BUDGET`` and the probe's rows and length, which each benchmark
    sets explicitly: ``probe_responses`` rows of at most ``probe_max_tokens`` real tokens.
    ``compute_dtype``: LoGRA's projection dtype (bf16 under autocast). ``logprob_chunk``:
    positions per chunk of the token log-probs (default: the library's). ``shard``: called
    on the (peft-wrapped) model before the optimizer is built, e.g. to FSDP2-shard it;
    ``sketch_accumulation``: LoGRA's setting of that name."""
    import torch

    from lightning_logra import LoGRAConfig, LoGRAOptimizer
    from lightning_logra.models import enable_activation_checkpointing

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    enable_activation_checkpointing(model)
    model.train()
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():  # peft asks transformers' deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LoGRAConfig().target_modules)))
    if shard is not None:
        shard(model)
    if mode == "logra":
        config = LoGRAConfig(rank=RANK, kl_budget=KL_BUDGET, kl_budget_final=KL_BUDGET, temperature=1.0,
                             probe_responses=probe_responses, probe_max_tokens=probe_max_tokens,
                             sketch_accumulation=sketch_accumulation)
        optimizer = LoGRAOptimizer(model, config, compute_dtype=compute_dtype)
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        fused = True if trainable[0].device.type == "cuda" else None
        optimizer = torch.optim.AdamW(trainable, lr=1e-6, betas=(0.9, 0.95), fused=fused)
    return Runner(mode, model, optimizer, hooks, logprob_chunk)


# --- the modes side by side ---------------------------------------------------------------

def alternate_modes(runners: dict[str, Runner], batch: Callable[[], tuple], reps: int, label: str | None = None) -> dict[str, list[dict]]:
    """Each runner's ``step`` samples over ``reps`` repetitions, on the same inputs per repetition.

    An untimed warm-up (the first micro-batch of one ``batch()`` and an update) per mode comes
    first; then every repetition draws fresh inputs and runs the modes in an order that rotates
    by one, so drift and order effects fall on every mode alike.
    """
    modes = tuple(runners)
    warmup_batches, warmup_advantages = batch()
    for mode in modes:  # first-call costs, not timed
        runners[mode].step(warmup_batches[:1], warmup_advantages[:1])
    samples = {mode: [] for mode in modes}
    for rep in range(reps):
        inputs = batch()
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            samples[mode].append(runners[mode].step(*inputs))
            if label:
                print(f"[{label}] rep {rep + 1}/{reps} {mode}: {samples[mode][-1]['step']:.1f} s", flush=True)
    return samples


def summarise_samples(samples: dict[str, list[dict]]) -> dict:
    """Every sample, the per-piece medians, and LoGRA's ratios to dense and LoRA from them."""
    medians = {mode: {piece: statistics.median(s[piece] for s in runs) for piece in runs[0]} for mode, runs in samples.items()}
    logra = medians["logra"]
    without_probe = logra["step"] - logra["kl_probe"]
    return {
        "samples": samples,
        "medians_s": medians,
        "logra_over_dense": logra["step"] / medians["dense"]["step"],
        "logra_over_dense_without_probe": without_probe / medians["dense"]["step"],
        "logra_over_lora": logra["step"] / medians["lora"]["step"],
        "logra_over_lora_without_probe": without_probe / medians["lora"]["step"],
        "probe_share_of_logra_step": logra["kl_probe"] / logra["step"],
        "paired_logra_over_dense": [l["step"] / d["step"] for l, d in zip(samples["logra"], samples["dense"])],
    }


# --- the machine, analytic rows, command line and outputs ------------------------------------

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
    """The machine as the results tables name it (also from results written before
    ``machine_info`` was shared: core_step's cpu_model / logical_cpus / torch_version)."""
    processor = machine.get("processor", machine.get("cpu_model"))
    cpus = machine.get("cpus", machine.get("logical_cpus"))
    torch_version = machine.get("torch", machine.get("torch_version"))
    return f"Machine: {processor}, {cpus} CPUs, torch {torch_version}, {machine['date_utc']}"


def cpu_caption(machine: dict) -> str:
    """``CPU (N cores), YYYY-MM-DD`` for figure titles."""
    return f"CPU ({machine.get('cpus', machine.get('logical_cpus'))} cores), {machine['date_utc'][:10]}"


def meta_memory_rows(names=None, world_sizes=(1, 8)) -> list[dict]:
    """``memory_report`` of each ``model_shapes.QWEN_SHAPES`` entry in ``names`` (default:
    all), built on the meta device, at each world size: the model, its parameter count and
    the report's fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import memory_report
    from model_shapes import QWEN_SHAPES

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


def stacked_bars(axis, labels: list[str], parts: dict[str, list[float]]) -> None:
    """One bar per label, stacked from ``parts`` (legend name -> one value per label)."""
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        axis.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]


def save_figure(figure, path: Path, title: str | None = None, legend_fontsize: int = 8) -> None:
    """A legend on every axis that labels something, the title (small), tight layout, PNG at 90 dpi."""
    for axis in figure.axes:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=legend_fontsize)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def argument_parser(doc: str, render_help: str = "only redraw .md/.png from a results file") -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, and ``--render JSON``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", type=Path, metavar="JSON", help=render_help)
    return parser


def save_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def write_outputs(stem: Path, result: dict, render: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> None:
    """``stem``.md (the rendered tables) and ``stem``.png; the tables printed."""
    table = render(result)
    stem.with_suffix(".md").write_text(table + "\n")
    plot(result, stem.with_suffix(".png"))
    print(table)
