"""Random projections A (rank x width): stable per-layer seeds and exact draws.

Every rank, device and run must derive the same A for a layer and update, so that
sketches are reducible across ranks and a resumed run is bit-identical: the seed depends
only on (base seed, update count, canonical layer name), and the draw uses a CPU generator.
Because A is a function of its seed, it need not be kept: a ``Projection`` either stores
its matrix or draws it again at every use (``regenerate_projections``), the same bits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

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
    if distribution == "rademacher":
        bits = _random_bits(seed, torch.empty(rank, width, dtype=torch.uint8))
        if projection_is_exact(rank, distribution, dtype):
            return _signs(bits, torch.empty(rank, width, dtype=dtype)).to(device)
        signs = bits.to(torch.float64).mul_(2.0).sub_(1.0)
        matrix = signs.mul_(1.0 / math.sqrt(rank))
    elif distribution == "gaussian":
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        matrix = torch.randn(rank, width, generator=generator, dtype=torch.float64).div_(math.sqrt(rank))
    else:
        raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")
    return matrix.to(device=device, dtype=dtype)


def _random_bits(seed: int, out: torch.Tensor) -> torch.Tensor:
    """0/1 into the uint8 ``out`` from a CPU generator seeded with ``seed``: the one draw that
    every Rademacher A comes from, allocated or into a buffer, so both give the same bits."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return torch.randint(0, 2, out.shape, generator=generator, out=out)


def _signs(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """+-1/sqrt(rank) from 0/1 ``bits`` into ``out``: 2b/sqrt(r) - 1/sqrt(r), exact in
    ``out``'s dtype when ``projection_is_exact`` (the float64 route's bits, much faster)."""
    scale = 1.0 / math.sqrt(bits.shape[0])
    return out.copy_(bits).mul_(2.0 * scale).sub_(scale)


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


@dataclass(eq=False)
class Projection:
    """One A (``rank`` x ``width``) and the seed it is drawn from: stored once per draw, or,
    with ``stored=None`` (``regenerate_projections``), drawn again at every use, which holds
    no memory between uses and gives the same bits."""

    rank: int
    width: int
    seed: int
    dtype: torch.dtype
    device: torch.device
    distribution: str
    stored: torch.Tensor | None

    @classmethod
    def draw(cls, rank: int, width: int, seed: int, *, device: torch.device, dtype: torch.dtype, distribution: str,
             regenerate: bool = False) -> Projection:
        projection = cls(rank, width, seed, dtype, torch.device(device), distribution, None)
        if not regenerate:
            projection.stored = projection._draw()
        return projection

    def matrix(self) -> torch.Tensor:
        """A itself: the stored tensor (updated in place by ``redraw``), or a fresh draw."""
        return self.stored if self.stored is not None else self._draw()

    def draw_into(self, out: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """A drawn into ``out`` (rank x width, float32 or float64) through ``bits`` (a uint8
        CPU buffer of at least rank x width elements), allocating no tensor: for applying
        an update, where nothing may run out of memory once the first weight has changed."""
        if self.distribution != "rademacher" or not projection_is_exact(self.rank, self.distribution, out.dtype):
            raise ValueError(f"draw_into needs exact Rademacher entries in {out.dtype}")
        return _signs(_random_bits(self.seed, bits[: self.rank * self.width].view(self.rank, self.width)), out)

    def redraw(self, seed: int) -> None:
        self.seed = seed
        if self.stored is not None:
            self.stored.copy_(self._draw())

    @property
    def nbytes(self) -> int:
        """Bytes held between uses: none when regenerated."""
        return 0 if self.stored is None else self.stored.nbytes

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever A does (a new seed, or an in-place change of the stored tensor)."""
        return (self.seed, 0 if self.stored is None else self.stored._version)

    def _draw(self) -> torch.Tensor:
        return make_projection(self.rank, self.width, self.seed, device=self.device, dtype=self.dtype,
                               distribution=self.distribution)
