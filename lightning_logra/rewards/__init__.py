"""Reward functions for RL post-training and a runner that isolates their failures."""

from lightning_logra.rewards.math import answers_match, extract_answer, math_reward
from lightning_logra.rewards.runner import RewardRunner, load_reward

__all__ = ["RewardRunner", "answers_match", "extract_answer", "load_reward", "math_reward"]
