from lightning_logra.rl.config import LoRAConfig, LossConfig, MultiTurnConfig, OptimizerConfig
from lightning_logra.rollout.config import RolloutConfig
from lightning_logra.modules.grpo import GRPOModule

__all__ = ["GRPOModule", "LoRAConfig", "LossConfig", "MultiTurnConfig", "OptimizerConfig", "RolloutConfig"]
