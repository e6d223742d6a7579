"""Micro-batches by tokens: rollout rows grouped so that each micro-batch holds at most a
budget of real tokens, to run as one packed row (``packed_sequence_logprobs``), and the
check that a model computes packed rows as it computes padded ones.

Under FSDP2 every rank must run as many forwards (and backwards) as every other, since each
gathers weights collectively; ranks that pack into fewer micro-batches run the difference
as micro-batches that change nothing (``collectives.max_over_ranks`` agrees the count).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_logra.rl.logprobs import packed_sequence_logprobs, sequence_logprobs

# The check's rows, left-padded as rollouts are: the longest first, so that the later
# sequences of the packed row start at an offset (a model that ignores the restarted
# position ids then lets them attend to the tokens before them).
CHECK_LENGTHS = (9, 4, 6)
# Packed and padded log-probs run different shapes and kernels, so round-off alone separates
# them. float32: measured <= 5e-7 on tiny models that pack correctly (Llama, Qwen2, GPT-2),
# against 1.0e-3 (BLOOM) and 6.2e-2 (OPT) on tiny ones that do not, 1.8e-3 and 8.5e-2 on
# real checkpoints. 16-bit weights keep 8 (bf16) or 11 (fp16) significant bits: round-off
# alone reaches 2e-3 on tiny models and more with the larger logits of trained ones, so
# only gross mismatches (OPT's) are caught there.
TOLERANCE_32_BIT = 1e-4
TOLERANCE_16_BIT = 5e-2


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups whose lengths sum to at most ``budget``: longest
    first, each into the first group with room. A length over the budget gets a group of
    its own (one warning names the budget)."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    groups: list[list[int]] = []
    room: list[int] = []
    oversized = 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > budget:
            oversized += 1
            groups.append([index])
            room.append(0)
            continue
        target = next((g for g, free in enumerate(room) if free >= length), None)
        if target is None:
            groups.append([])
            room.append(budget)
            target = len(groups) - 1
        groups[target].append(index)
        room[target] -= length
    if oversized:
        # One message per budget: Python's warning filter shows it once per process.
        warnings.warn(f"batching.micro_batch_tokens = {budget} is less than the real tokens of some sequences: each "
                      "of them runs as a micro-batch of its own (raise batching.micro_batch_tokens to bound every "
                      "micro-batch)",
                      stacklevel=2)
    return [sorted(group) for group in groups]


def token_micro_batches(attention_mask: torch.Tensor, rows: slice, budget: int) -> list[torch.Tensor]:
    """The rows ``rows`` of a padded batch as micro-batches of at most ``budget`` real
    tokens each: index tensors into the batch, ascending within each micro-batch."""
    lengths = attention_mask[rows].sum(dim=1).tolist()
    return [torch.tensor(group, device=attention_mask.device) + rows.start
            for group in first_fit_decreasing(lengths, budget)]


def row_micro_batches(rows: slice, size: int, device: torch.device) -> list[torch.Tensor]:
    """The rows ``rows`` in consecutive micro-batches of ``size`` rows, as index tensors."""
    return [torch.arange(start, min(start + size, rows.stop), device=device) for start in range(rows.start, rows.stop, size)]


@torch.no_grad()
def packed_padded_difference(model: nn.Module) -> float:
    """The largest |packed - padded| log-prob of ``model`` over the scored tokens of a few
    rows of random token ids (``CHECK_LENGTHS``), computed in eval mode (dropout would make
    the two differ) from a private generator: the global random state and every module's
    training mode are left as they were."""
    embeddings = model.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor(CHECK_LENGTHS)
    width = int(lengths.max())
    input_ids = torch.randint(embeddings.num_embeddings, (len(CHECK_LENGTHS), width), generator=generator)
    attention_mask = (torch.arange(width) >= width - lengths[:, None]).long()
    device = embeddings.weight.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with _ieee_float32_matmuls():
            padded = sequence_logprobs(model, input_ids, attention_mask)
            packed = packed_sequence_logprobs(model, input_ids, attention_mask)
    finally:
        for module, training in modes.items():
            module.training = training
    scored = (attention_mask[:, :-1] * attention_mask[:, 1:]).bool()
    return float((packed - padded)[scored].abs().max())


def check_packing(model: nn.Module, *, any_rank: Callable[[bool], bool] = bool) -> float:
    """Refuse packing for a model whose packed log-probs differ from its padded ones (e.g.
    OPT and BLOOM, whose causal masks ignore position ids, so that packed sequences attend
    to each other): ``ValueError`` naming the model's class and the difference. Returns the
    difference. Under FSDP2 every rank must call it; ``any_rank`` makes them all refuse
    when one does."""
    difference = packed_padded_difference(model)
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = TOLERANCE_32_BIT if torch.finfo(dtype).bits >= 32 else TOLERANCE_16_BIT
    if any_rank(difference > tolerance):
        raise ValueError(
            f"{model_class_name(model)}: packed log-probs differ from the padded ones by up to {difference:.2g} on a "
            f"test batch ({dtype} weights allow {tolerance:g}): this model's attention does not follow packed "
            "position ids, so batching.micro_batch_tokens would train on wrong log-probs; unset "
            "batching.micro_batch_tokens (and set batching.micro_batch_size) to train it on padded micro-batches")
    return difference


def model_class_name(model: nn.Module) -> str:
    """The Hugging Face class of ``model``, through peft's and FSDP2's wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cls in type(base).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(base).__name__


@contextmanager
def _ieee_float32_matmuls() -> Iterator[None]:
    """float32 matmuls at full precision for a while: TF32 on CUDA (or bf16 in oneDNN), as
    ``torch.set_float32_matmul_precision("high")`` turns on, rounds like 16-bit weights and
    would make a model that packs correctly look like one that does not. The per-backend
    settings (torch >= 2.9; older versions keep theirs) are restored after: the legacy
    getter raises once the two APIs disagree."""
    matmul_backends = (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
    backends = [backend for backend in matmul_backends if hasattr(backend, "fp32_precision")]
    saved = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, precision in zip(backends, saved):
            backend.fp32_precision = precision
