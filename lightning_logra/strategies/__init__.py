"""Lightning strategies; importing this module registers ``logra_fsdp`` with both the
Trainer's and Fabric's strategy registries."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_logra.strategies.checkpoints.logra_state import convert_legacy_state
from lightning_logra.strategies.fabric import LoGRAFabricStrategy
from lightning_logra.strategies.trainer import LoGRAFSDPStrategy, claim_checkpoint_folders

STRATEGY_NAME = "logra_fsdp"
_DESCRIPTION = "FSDP2 data parallelism (none on one device) with LoGRA sketched-gradient updates"

if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(STRATEGY_NAME, LoGRAFSDPStrategy, description=_DESCRIPTION)
if STRATEGY_NAME not in FABRIC_STRATEGY_REGISTRY:
    FABRIC_STRATEGY_REGISTRY.register(STRATEGY_NAME, LoGRAFabricStrategy, description=_DESCRIPTION)

__all__ = ["STRATEGY_NAME", "LoGRAFSDPStrategy", "LoGRAFabricStrategy", "claim_checkpoint_folders",
           "convert_legacy_state"]
