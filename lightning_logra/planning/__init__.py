"""Whole-step memory planning: what one RL step holds per rank (weights, gradients, dense,
LoRA or LoGRA optimizer state, activations, logits, a KL reference, a colocated vLLM), for
"what fits" tables. Above core: LoGRA's own state is ``core.memory.memory_report``, which
``step_memory`` builds on."""

from lightning_logra.planning.step_memory import StepMemory, StepSettings, step_memory

__all__ = ["StepMemory", "StepSettings", "step_memory"]
