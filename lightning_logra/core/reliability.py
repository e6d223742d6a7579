"""Guards that keep a long run from going wrong silently: out-of-memory errors that say
where and what to change, and a start-up check that every rank derived the same LoGRA."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_logra.core.sketch import SketchSet

@contextmanager
def memory_phase(phase: str, settings: str):
    """Re-raise an out-of-memory error naming the phase and the caller's ``settings`` that
    shrink it (each caller knows its own knobs)."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"out of memory during the {phase} phase of the RL step; settings that reduce it: "
            f"{settings}. Original error: {error}"
        ) from error


def fingerprints(sketches: SketchSet, config_json: str) -> torch.Tensor:
    """float64 [config hash, one checksum per layer's projection]: equal on every rank iff
    the ranks use the same configuration and drew the same projections."""
    digest = int.from_bytes(hashlib.blake2b(config_json.encode(), digest_size=6).digest(), "little")
    values = [float(digest)]
    for state in sketches:
        rows = state.projection.double().sum(dim=1)
        weights = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=rows.device)
        values.append(float(rows @ weights))
    return torch.tensor(values, dtype=torch.float64, device=sketches.buffer.device)


def verify_ranks_agree(sketches: SketchSet, config: dict, group: dist.ProcessGroup | None = None) -> None:
    """All-gather the fingerprints and raise ``ValueError`` naming the first disagreement."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    local = fingerprints(sketches, json.dumps(config, sort_keys=True))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    names = ["the LoGRA configuration"] + [f"the projection of layer {state.name}" for state in sketches]
    for rank, other in enumerate(gathered):
        differing = (other != gathered[0]).nonzero()
        if differing.numel():
            raise ValueError(f"ranks disagree: rank {rank} and rank 0 derived different {names[int(differing[0])]}")
