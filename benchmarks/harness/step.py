"""The replayed RL step of each mode: rollouts built once and replayed through the
library's own step (see the package docstring), the mode builders and their state sizes."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any


MODES = ("dense", "lora", "logra")
RANK = 256  # LoRA and LoGRA rank
# A flat KL budget (kl_budget = kl_budget_final), so alpha = min(3, sqrt(2e-4 / prediction))
# at every step, warm-up and repetitions alike, as when the scripts scaled the step by hand.
KL_BUDGET = 2e-4
# Profiler ranges around the pieces of Runner.step (memory_ledger.py reads them): the update
# function's own two (``rl.step.RANGES``) and each backward, which the harness marks.
RANGES = {"forward_backward": "rl.forward_backward", "backward": "bench.backward", "optimizer_step": "rl.optimizer_step"}


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
    from lightning_logra.rl.advantages import group_advantages
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


def random_replay(model, rows: int, prompt_tokens: int, completion_tokens: int, vocab_size: int, *,
                  num_generations: int, seed: int, settings, context: Callable[[], Any] = nullcontext) -> Replay:
    """``replay_rollouts`` of ``random_token_rows``: the rows and their rewards both drawn
    from ``seed``, scored by ``model``."""
    ids = random_token_rows(rows, prompt_tokens, completion_tokens, vocab_size, num_generations=num_generations,
                            seed=seed)
    return replay_rollouts(model, ids, prompt_tokens, num_generations=num_generations, seed=seed, settings=settings,
                           context=context)


def micro_batching(completion_tokens: int, *, micro_batch_size: int = 1, logprob_chunk: int | None = None,
                   micro_batch_tokens: int | None = None):
    """GRPOModule's defaults (loss ``LossConfig()``: grpo; sampling temperature 1; no
    truncated importance sampling, as with the HF engine) but for the micro-batch size (or
    ``micro_batch_tokens``: packed micro-batches) and the log-prob chunk, which each
    benchmark sets."""
    from lightning_logra.rl.batch import MicroBatching
    from lightning_logra.rl.config import LossConfig
    from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE

    return MicroBatching(loss=LossConfig(), micro_batch_size=micro_batch_size, temperature=1.0,
                         chunk_size=logprob_chunk or DEFAULT_CHUNK_SIZE, max_completion_length=completion_tokens, tis=False,
                         micro_batch_tokens=micro_batch_tokens)


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
        the library's ``rl.step.run_update``, as ``GRPOModule._update`` calls it. Returns its
        seconds by piece: ``forward_backward``, ``update``, ``kl_probe`` (LoGRA's
        ``StepReport.probe_s``; 0 otherwise) and their sum ``step``. ``phase(name)`` is called
        as ``forward_backward`` and ``update`` end, so the caller can read memory there.
        Profiler ranges ``RANGES`` mark the forward/backward, each backward and the optimizer
        step (LoGRA's own ``logra.prepare`` / ``logra.probe`` / ``logra.apply`` sit inside
        the last)."""
        import torch.distributed as dist
        from torch.profiler import record_function

        from lightning_logra.rl.metrics import PassTotals
        from lightning_logra.rl.step import run_update

        rows = rows or slice(0, replay.rows)
        batch = replay.batch
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        clock = Clock(self.hooks.synchronize)
        times = {"forward_backward": 0.0, "update": 0.0, "kl_probe": 0.0}

        def backward(loss):
            with record_function(RANGES["backward"]):
                loss.backward()

        def backward_done():
            times["forward_backward"] = clock.lap()
            phase("forward_backward")

        # A partial batch (the warm-up's first micro-batch) is probed in its own order.
        count = rows.stop - rows.start
        generations = replay.num_generations if count % replay.num_generations == 0 else 1
        with self.hooks.context():
            update = run_update(self.model, self.optimizer, batch, rows, self.settings, backward=backward,
                                passes=PassTotals.zeros(batch.mask.device), num_generations=generations,
                                logra=self.logra is not None, world=world, after_backward=backward_done)
        if update is None:
            raise RuntimeError("the replayed rows have no completion token to train on")
        seconds = clock.lap()
        report = update.report
        if report is not None:
            if report.skipped:  # a skipped step changed nothing: its times measure nothing
                raise RuntimeError(f"LoGRA skipped the benchmark step: {report.skip_reason}")
            self.last_report = report
            # The report's clocks do not synchronize the device; the step's synchronized wall
            # time minus the probe is prepare_s + apply_s plus the work apply left queued.
            times["kl_probe"] = report.probe_s
        times["update"] = seconds - times["kl_probe"]
        phase("update")
        times["step"] = sum(times.values())
        return times


def build_mode(mode: str, model, settings, *, probe_responses: int, probe_max_tokens: int, compute_dtype=None,
               hooks: StepHooks = StepHooks(), shard: Callable[[Any], None] | None = None, activation_checkpointing: bool = True,
               lora_rank: int = RANK, **logra_settings) -> Runner:
    """``model`` (a Hugging Face causal LM) trained as GRPOModule trains it in ``mode``:
    activation checkpointing on, then dense AdamW (every parameter), LoRA r=256 (the
    library's ``with_lora``: peft on the seven projections, AdamW over the adapters) or
    LoGRA r=256 (``LoGRAOptimizer``, which freezes everything else).

    AdamW: ``rl.step.build_optimizer`` with ``OptimizerConfig()``, as ``configure_optimizers``
    builds it (its warm-up schedule is left out: it changes the lr, not the work). LoGRA:
    the library's defaults but for a flat KL budget of ``KL_BUDGET`` and the probe's rows and
    length, which each benchmark sets: ``probe_responses`` rows of at most
    ``probe_max_tokens`` real tokens; ``logra_settings`` set other ``LoGRAConfig`` fields.
    ``compute_dtype``: LoGRA's projection dtype (bf16 under autocast). ``shard``: called on
    the (peft-wrapped) model before the optimizer is built, e.g. to FSDP2-shard it.
    ``activation_checkpointing`` and ``lora_rank`` (and LoGRA's ``rank`` among
    ``logra_settings``) change what the benchmarks' default step holds, as a config would."""
    from lightning_logra import LoGRAConfig, LoGRAOptimizer
    from lightning_logra.models import enable_activation_checkpointing, with_lora
    from lightning_logra.rl.config import LoRAConfig, OptimizerConfig
    from lightning_logra.rl.step import build_optimizer

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    if mode == "lora":
        model = with_lora(model, LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    if shard is not None:
        shard(model)
    if mode == "logra":
        config = LoGRAConfig(**{"rank": RANK, **logra_settings}, kl_budget=KL_BUDGET, kl_budget_final=KL_BUDGET,
                             probe_responses=probe_responses, probe_max_tokens=probe_max_tokens)
        optimizer = LoGRAOptimizer(model, config, compute_dtype=compute_dtype)
    else:
        optimizer = build_optimizer(model.parameters(), OptimizerConfig())
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
