"""Random projections A (rank x width): stable per-layer seeds and exact draws.

Every rank, device and run must derive the same A for a layer and update, so that
sketches are reducible across ranks and a resumed run is bit-identical: the seed depends
only on (base seed, update count, canonical layer name), and the draw uses a CPU generator.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch

SEED_MASK = 2**62 - 1
# rank "auto": the paper's rank where it fits, never more than a quarter of the narrowest
# input width (see auto_rank).
MAX_AUTO_RANK = 256
AUTO_RANK_WIDTH_DIVISOR = 4
# Components that wrappers (activation checkpointing, FSDP1, torch.compile) insert into
# qualified names; removing them keeps a layer's seed independent of how it is wrapped.
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def name_hash(name: str) -> int:
    """8-byte BLAKE2b digest of the canonical name, read as a little-endian integer."""
    digest = hashlib.blake2b(canonical_name(name).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def projection_seed(base_seed: int, update: int, name: str) -> int:
    return (base_seed * 1_000_003 + update * 7_919 + name_hash(name)) & SEED_MASK


def make_projection(
    rank: int,
    width: int,
    seed: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    distribution: str = "rademacher",
) -> torch.Tensor:
    """Draw A with E[A^T A] = I: Rademacher +-1/sqrt(rank) or Gaussian N(0, 1)/sqrt(rank).

    Drawn on the CPU so that the same seed gives the same matrix on every device.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    if distribution == "rademacher":
        bits = torch.randint(0, 2, (rank, width), generator=generator, dtype=torch.uint8)
        signs = bits.to(torch.float64).mul_(2.0).sub_(1.0)
        matrix = signs.mul_(1.0 / math.sqrt(rank))
    elif distribution == "gaussian":
        matrix = torch.randn(rank, width, generator=generator, dtype=torch.float64).div_(math.sqrt(rank))
    else:
        raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")
    return matrix.to(device=device, dtype=dtype)


def auto_rank(widths: Iterable[int]) -> int:
    """The rank ``rank: auto`` resolves to for targets of these input widths (in_features):
    the largest power of 4 that is <= min(256, narrowest width / 4), and at least 1.

    Why: computing X A^T costs tokens x width x rank, i.e. rank / out_features of the
    layer's own forward; at r = 256 that is about a third of the target layers' forward on
    SmolLM2-135M (width 576, k/v out 192). Capping r at a quarter of the narrowest input
    width bounds it for small models while every model with inputs >= 1024 wide (Qwen2.5-
    1.5B and up, the paper's range) keeps the paper's 256. A power of 4 keeps the Rademacher
    entries +-1/sqrt(r) exact in bfloat16 (``projection_is_exact``), so A can be stored and
    used in the compute dtype. Widths 576 -> 64, 896 -> 64, 1024 -> 256, 32 -> 4.
    """
    widths = list(widths)
    if not widths or any(width < 1 for width in widths):
        raise ValueError(f"rank 'auto' needs the input widths of at least one target, got {widths}")
    limit = min(MAX_AUTO_RANK, min(widths) // AUTO_RANK_WIDTH_DIVISOR)
    rank = 1
    while rank * 4 <= limit:
        rank *= 4
    return rank


def resolve_rank(rank: int | str, widths: Iterable[int]) -> int:
    """``rank`` itself when it is an int, ``auto_rank(widths)`` when it is ``"auto"``."""
    if rank == "auto":
        return auto_rank(widths)
    if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1:
        return rank
    raise ValueError(f"LoGRAConfig.rank = {rank!r} is invalid: must be an integer >= 1 or 'auto'")


def projection_is_exact(rank: int, distribution: str, dtype: torch.dtype) -> bool:
    """Whether every entry of A is representable in ``dtype`` without rounding.

    Rademacher entries are +-1/sqrt(rank): exact in any float format when 1/sqrt(rank) is
    a power of two (rank a power of 4: 1, 4, 16, 64, 256, ...). Gaussian entries are not.
    """
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(
            f"rank must be an int here, got {rank!r}; resolve rank 'auto' against the model's targets first "
            "(projection.resolve_rank, or read LoGRAOptimizer.config.rank)"
        )
    if dtype in (torch.float32, torch.float64):
        return True
    if distribution != "rademacher":
        return False
    root = math.isqrt(rank)
    return root * root == rank and root & (root - 1) == 0


def projection_storage_dtype(rank: int, distribution: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Store A in the compute dtype when that is exact (half the memory in bf16), else float32."""
    if compute_dtype == torch.float64:
        return torch.float64
    return compute_dtype if projection_is_exact(rank, distribution, compute_dtype) else torch.float32
