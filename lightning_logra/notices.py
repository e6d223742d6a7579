"""Third-party notices that a user of this library cannot act on, silenced narrowly (one
message from one module) where our code starts the work that raises them, never at import."""

from __future__ import annotations

import logging
import warnings


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
