"""Reward functions for RL post-training (TRL's convention) and a runner that isolates their failures."""

from lightning_logra.rewards.code import code_execution_reward, extract_code
from lightning_logra.rewards.config import DEFAULT_REWARD, RewardConfig
from lightning_logra.rewards.completions import completion_text, format_completions
from lightning_logra.rewards.math import answers_match, extract_answer, math_reward
from lightning_logra.rewards.reasoning_gym import reasoning_gym_reward
from lightning_logra.rewards.runner import RewardRunner, RewardScores, RewardWarning, load_reward

__all__ = [
    "DEFAULT_REWARD",
    "RewardConfig",
    "RewardRunner",
    "RewardScores",
    "RewardWarning",
    "answers_match",
    "code_execution_reward",
    "completion_text",
    "extract_answer",
    "extract_code",
    "format_completions",
    "load_reward",
    "math_reward",
    "reasoning_gym_reward",
]
