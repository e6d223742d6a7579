from lightning_logra.rl.config import LoRAConfig, LossConfig, OptimizerConfig, RolloutConfig
from lightning_logra.modules.grpo import GRPOModule

__all__ = ["GRPOModule", "LoRAConfig", "LossConfig", "OptimizerConfig", "RolloutConfig"]
