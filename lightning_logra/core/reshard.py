"""Gathered weights freed after a forward that no backward follows.

FSDP2 keeps a root module's gathered (unsharded) weights after its forward, since a backward
would gather them again at once; so does any module the user sharded with
``reshard_after_forward=False``. After a forward without a backward (the KL probe, a
generation, a reference or old-policy pass) they stay whole until the next backward: memory
held all that time (the embeddings and head of a tied model: 0.12 GiB per rank of 4 at
0.42B), and a forward after an optimizer changed those shards reads the stale copy (FSDP2
gathers only what is sharded).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def reshard(model: nn.Module) -> None:
    """Free every weight FSDP2 holds gathered in ``model``; nothing where nothing is sharded
    or gathered. Every rank must call it when they ran the same forwards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
