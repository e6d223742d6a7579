"""P = X A^T, the projected layer input: where it is computed, and how often.

Two savings that keep every sketch bit for bit what it would be otherwise:
- under non-reentrant activation checkpointing a layer's forward runs twice (the forward,
  whose saved tensors the checkpoint drops, and the recompute), so the sketch hook saves X
  and projects it once, in backward (``under_activation_checkpointing``, ``AutocastState``);
- with ``share_projection_by_input`` the targets that read one input tensor (q/k/v,
  gate/up) share one A, and P is computed once per group (``projection_groups``,
  ``SharedProjectedInput``), in the sketch hooks and in the KL probe alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_logra.core.projection import Projection

# share_projection_by_input: targets of one parent module with the same input width whose
# last name components are listed together here read the same input tensor (every Hugging
# Face decoder: Llama, Qwen2, Mistral, Gemma, ...), so they can share A and P = X A^T.
SHARED_INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def projection_groups(targets: Sequence[tuple[str, nn.Linear]]) -> list[list[int]]:
    """Indices into ``targets`` of the layers that share one A under
    ``share_projection_by_input``, groups ordered by their first member (module order).

    Layers share when they have the same parent module (canonical name), the same input
    width and last name components listed in one entry of ``SHARED_INPUT_GROUPS``; every
    other target is a group of one. Sharing is an estimate that stays unbiased for each
    layer (E[A^T A] = I holds per layer); it saves compute only where the members really
    receive one tensor, which holds for the listed names in Hugging Face decoders."""
    groups: dict[tuple, list[int]] = {}
    for index, (name, module) in enumerate(targets):
        parent, _, leaf = name.rpartition(".")
        listed = next((i for i, names in enumerate(SHARED_INPUT_GROUPS) if leaf in names), None)
        key = ("shared", parent, module.in_features, listed) if listed is not None else ("own", name)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def linear_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """X of an ``nn.Linear`` call as a ``with_kwargs`` hook sees it: positional or ``input=``."""
    return args[0] if args else kwargs["input"]


def project(inputs: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """P = X A^T (tokens x rank), without grad, in the activation dtype (autocast applies)."""
    with torch.no_grad():
        if projection.dtype != inputs.dtype:
            projection = projection.to(inputs.dtype)
        return inputs.reshape(-1, inputs.shape[-1]) @ projection.T


@dataclass(frozen=True)
class AutocastState:
    """The autocast state a deferred P = X A^T must be computed under to equal the forward's."""

    device_type: str
    enabled: bool
    dtype: torch.dtype | None

    @classmethod
    def current(cls, device_type: str) -> AutocastState:
        if not torch.amp.is_autocast_available(device_type):
            return cls(device_type, False, None)
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def restored(self):
        """Enter exactly this state (also switching autocast off if backward runs inside an
        autocast region the forward was not in)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class SharedProjectedInput:
    """P = X A^T of one projection group's latest input, handed to every member that reads
    the same tensor, so the group computes it once per forward (once per backward under
    activation checkpointing, where each member saved its own view of the recomputed X).

    A hit needs the same storage, view, version counter, projection version and autocast
    state; the cache holds a reference to the input, so its storage (and address) cannot be
    reused while cached. It is released once every member took it, and by ``zero_()``."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.clear()

    def clear(self) -> None:
        self.inputs: torch.Tensor | None = None
        self.projected: torch.Tensor | None = None
        self.key: tuple | None = None
        self.uses = 0

    def project(self, inputs: torch.Tensor, projection: Projection) -> torch.Tensor:
        key = _input_key(inputs, projection)
        if self.inputs is not None and key == self.key:
            projected = self.projected
            self.uses += 1
            if self.uses >= self.members:
                self.clear()
            return projected
        projected = project(inputs, projection.matrix())
        self.inputs, self.projected, self.key, self.uses = inputs, projected, key, 1
        return projected


def _input_key(inputs: torch.Tensor, projection: Projection) -> tuple:
    return (
        inputs.untyped_storage().data_ptr(),
        inputs.storage_offset(),
        tuple(inputs.shape),
        inputs.stride(),
        inputs.dtype,
        inputs.device,
        inputs._version,
        projection.version,
        AutocastState.current(inputs.device.type),
    )


_CHECKPOINT_MODULE = torch.utils.checkpoint.__name__


def under_activation_checkpointing() -> bool:
    """Whether a tensor saved for backward now goes to non-reentrant activation
    checkpointing (``torch.utils.checkpoint(use_reentrant=False)``, which Hugging Face's
    activation checkpointing, torch.distributed's ``checkpoint_wrapper`` and FSDP2's
    composable ``checkpoint`` use): in its forward the saved tensor is dropped and
    recomputed, in its recompute it is kept.

    Asked per call, so it is right whatever enabled checkpointing, in whichever order, and
    for layers that skip it (HF checkpoints only in training mode). It reads torch's
    innermost saved-tensor hooks (``torch._C._autograd._top_saved_tensors_default_hooks``,
    private) and checks that ``torch.utils.checkpoint`` defined them. If that API ever goes
    away this returns False: P is then computed in the forward as without checkpointing,
    correct and as fast as before (tests/core/test_checkpointed_sketch.py pins it).
    Reentrant checkpointing needs nothing: its forward runs without grad, so the hook only
    works in the recompute."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        hooks = top(False)
    except (TypeError, RuntimeError):
        return False
    return hooks is not None and getattr(hooks[0], "__module__", None) == _CHECKPOINT_MODULE
