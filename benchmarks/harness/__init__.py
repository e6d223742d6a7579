"""The benchmarks' one harness: the replayed RL step of each mode, the modes side by side,
their summaries, the machine, and the outputs every script writes.

**The step is the library's own.** ``replay_rollouts`` builds a rollout batch once, with a
fixed generator: prompt and completion token ids (each group of ``num_generations`` rows
shares its prompt), completion masks, the rollout log-probs (the initial weights' own, as
the HF engine reports them, so the rollout/trainer mismatch starts at zero) and GRPO
advantages of random rewards (``group_advantages``). ``Runner.step`` replays it through
``rl.step.run_update``, the function ``GRPOModule`` runs per optimizer step: the
micro-batched forward/backward (``rl.batch.backward_micro_batches``: chunked token
log-probs, the default ``LossConfig()`` loss, grpo, and its weighting), then the update:
``torch.optim.AdamW.step()`` on ``rl.step.build_optimizer``'s AdamW, as
``GRPOModule.configure_optimizers`` builds it (dense, LoRA), or ``LoGRAOptimizer.step``
with the batch's probe rows and log-prob pairs (``rl.step.logra_step_inputs``), the inputs
``GRPOModule`` hands the ``logra_fsdp`` strategy.
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

from .step import (
    MODES, RANK, RANGES, default_generations, prompt_share, random_replay, random_token_rows, replay_rollouts,
    micro_batching, StepHooks, Clock, Runner, build_mode, optimizer_state_bytes,
)
from .pairing import alternate_modes, summarise, contention_line
from .records import (
    ROOT, machine_info, machine_line, status_kib, cpu_caption, code_line, code_version, step_line, meta_memory_rows,
    argument_parser, check_smoke_out, command_line, run_module, save_json, load_json, write_outputs,
    stacked_bars, save_figure, pyplot,
)

__all__ = [
    "Clock",
    "MODES",
    "RANGES",
    "RANK",
    "ROOT",
    "Runner",
    "StepHooks",
    "alternate_modes",
    "argument_parser",
    "build_mode",
    "check_smoke_out",
    "code_line",
    "code_version",
    "command_line",
    "contention_line",
    "cpu_caption",
    "default_generations",
    "load_json",
    "machine_info",
    "machine_line",
    "meta_memory_rows",
    "micro_batching",
    "optimizer_state_bytes",
    "prompt_share",
    "pyplot",
    "random_replay",
    "random_token_rows",
    "replay_rollouts",
    "run_module",
    "save_figure",
    "save_json",
    "stacked_bars",
    "status_kib",
    "step_line",
    "summarise",
    "write_outputs",
]
