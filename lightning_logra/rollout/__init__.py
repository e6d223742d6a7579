"""Rollout engines: sample completions and the log-probs of their tokens."""

from lightning_logra.rollout.base import RolloutEngine, Rollouts, pack_rollouts, select_rows
from lightning_logra.rollout.hf import HFRolloutEngine
from lightning_logra.rollout.vllm import VLLMRolloutEngine

__all__ = ["HFRolloutEngine", "RolloutEngine", "Rollouts", "VLLMRolloutEngine", "pack_rollouts", "select_rows"]
