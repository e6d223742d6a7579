"""Third-party notices that a user of this library cannot act on, silenced narrowly (one
message from one module) where our code starts the work that raises them, never at import."""

from __future__ import annotations

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
