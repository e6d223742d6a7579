"""The few collectives a GRPO step needs across data-parallel ranks (no-ops on one process)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_ranks(values: torch.Tensor) -> torch.Tensor:
    """Every rank's ``values`` (1-D, same size everywhere), concatenated in rank order."""
    if not _distributed():
        return values
    gathered = torch.empty(values.numel() * dist.get_world_size(), dtype=values.dtype, device=values.device)
    dist.all_gather_single(gathered, values.contiguous())
    return gathered


def gather_objects(values: list) -> list:
    """Every rank's list of picklable ``values``, concatenated in rank order."""
    if not _distributed():
        return values
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [value for part in gathered for value in part]


def global_counts(mask: torch.Tensor) -> torch.Tensor:
    """Rows, rows with a masked token, and masked tokens, each summed over ranks: the
    normalisers of a data-parallel mean (per sequence, per row with tokens, per token)."""
    counts = torch.stack([torch.tensor(float(mask.shape[0]), device=mask.device), mask.any(dim=1).sum().float(),
                          mask.sum().float()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return counts


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank, so that all ranks take the same branch."""
    if not _distributed():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def max_over_ranks(count: int, device: torch.device) -> int:
    """The largest ``count`` over ranks (``count`` itself on one process)."""
    if not _distributed():
        return count
    value = torch.tensor([count], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
