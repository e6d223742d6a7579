"""Third-party notices that a user of this library cannot act on, silenced narrowly (one
message from one module) where our code starts the work that raises them, never at import."""

from __future__ import annotations

import logging
import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import nn


def quiet_lightning_pytree_notice() -> None:
    """Lightning 2.6's batch flattening (``lightning/pytorch/utilities/_pytree.py``) builds
    torch's ``LeafSpec``, which recent torch deprecates with a FutureWarning on every fit.
    Installed when a ``logra_fsdp`` strategy or the ``logra`` command starts a run."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def quiet_eval_mode_notice_for_frozen(module: nn.Module, frozen: list[nn.Module]) -> None:
    """Lightning warns at the start of every fit that finds modules in eval mode; a frozen
    copy (a KL reference) is in eval mode by design. Silenced only when the frozen copies
    are exactly the modules in eval mode (the warning names their count), so a policy
    module a user left in eval mode is still reported. Call it from ``on_fit_start``."""
    in_eval = sum(not m.training for m in module.modules())
    frozen_in_eval = sum(not m.training for copy in frozen for m in copy.modules())
    if in_eval and in_eval == frozen_in_eval:
        warnings.filterwarnings(
            "ignore", message=rf"Found {in_eval} module\(s\) in eval mode at the start of training",
            category=PossibleUserWarning,
        )


def quiet_manual_optimization_checkpoint_notice() -> None:
    """Lightning 2.6's ``ModelCheckpoint(every_n_train_steps=...)`` warns at every save of a
    module with manual optimization that the checkpoint holds the weights after the step.
    For ``GRPOModule`` that is the resume point (resumed runs match uninterrupted ones bit
    for bit), so the notice, which suggests copying the weights every step, is dropped."""
    warnings.filterwarnings(
        "ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps",
        category=UserWarning,
    )


# Lightning's console lines that the ``logra`` command's users cannot act on: an
# advertisement for a cloud logger, and the note that a model summary callback is already
# configured (the command adds LoGRAModelSummary itself).
LIGHTNING_CONSOLE_NOISE = (
    "💡 Tip: For seamless cloud logging",
    "Trainer already configured with model summary callbacks",
)


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_CONSOLE_NOISE)


def quiet_lightning_console() -> None:
    """Drop ``LIGHTNING_CONSOLE_NOISE`` from Lightning's rank-zero logger (once per process)."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages())
