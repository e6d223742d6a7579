from lightning_logra.rewards.config import RewardConfig
from lightning_logra.rl.config import (BatchingConfig, LoggingConfig, LoRAConfig, LossConfig, MultiTurnConfig,
                                       OptimizerConfig)
from lightning_logra.rollout.config import RolloutConfig
from lightning_logra.modules.grpo import GRPOModule
from lightning_logra.modules.sft import SFTModule

__all__ = ["BatchingConfig", "GRPOModule", "LoggingConfig", "LoRAConfig", "LossConfig", "MultiTurnConfig",
           "OptimizerConfig", "RewardConfig", "RolloutConfig", "SFTModule"]
