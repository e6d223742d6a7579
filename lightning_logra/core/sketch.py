"""Sketched weight gradients: backward accumulates S = dY^T (X A^T) instead of dY^T X.

Each target ``nn.Linear`` gets its weight frozen and a forward hook. The hook projects the
layer input once, P = X A^T (tokens x rank), and routes the output through an autograd
function that, in backward, adds dY^T P into the layer's float32 sketch S (d x rank) and
passes dY through unchanged, so input gradients still flow. Over all micro-batches
S = G A^T, where G is the dense gradient that is never formed.

Under non-reentrant activation checkpointing the hook runs twice per micro-batch (the
forward, whose saved tensors the checkpoint drops, and the recompute), so there it saves X
instead and computes P once, in backward, with the same matmul: the same sketch, bit for
bit. X is saved by a forward pre-hook, before the layer's matmul: the recompute stops at
the region's last saved tensor, so a save after the matmul would make it redo the last
target's matmul (down_proj's, in a decoder layer) only to save X again. With
``share_projection_by_input`` the targets that read one input tensor (q/k/v, gate/up)
share one A, and P is computed once per group. Under FSDP2 with sharded
accumulation the backward hands dY^T P to a ``ShardedAccumulator`` instead, which
reduce-scatters it so that ``sketch`` holds only the rank's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.projected_input import (
    AutocastState,
    SharedProjectedInput,
    linear_input,
    project,
    projection_groups,
    under_activation_checkpointing,
)
from lightning_logra.core.projection import (
    Projection,
    canonical_name,
    projection_seed,
    projection_storage_dtype,
    resolve_rank,
)


@dataclass(eq=False)
class SketchState:
    """Everything LoGRA keeps for one target layer."""

    name: str
    module: nn.Linear
    source: Projection  # A: rank x in_features, stored or regenerated (one object for a shared group)
    sketch: torch.Tensor  # S: out_features x rank, float32, a view into one flat buffer (owned rows only when sharded)
    second_moment: torch.Tensor  # v: one float32 entry per weight row (per owned row when row-sharded)
    backward_calls: int = 0
    handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    # The name A's seed derives from: this layer's own, or its projection group's first member's.
    projection_name: str | None = None
    shared_input: SharedProjectedInput | None = field(default=None, repr=False)
    # None: contributions add into ``sketch`` here; else a ShardedAccumulator reduces them
    accumulator: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.projection_name is None:
            self.projection_name = self.name

    @property
    def weight(self) -> nn.Parameter:
        return self.module.weight

    @property
    def projection(self) -> torch.Tensor:
        """A itself (drawn afresh at each access when regenerated)."""
        return self.source.matrix()

    def project(self, inputs: torch.Tensor) -> torch.Tensor:
        """P = X A^T for this layer: computed, or taken from the group member that already
        computed it for the same input tensor."""
        if self.shared_input is None:
            return project(inputs, self.source.matrix())
        return self.shared_input.project(inputs, self.source)


@dataclass(eq=False)
class SketchSet:
    """The installed sketches of one model: per-layer states over one flat float32 buffer.

    One buffer lets a single collective reduce every sketch and a single call zero them.
    """

    states: list[SketchState]
    buffer: torch.Tensor
    accumulator: Any = None  # the ShardedAccumulator every state hands contributions to, if any

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    @property
    def rank(self) -> int:
        """The rank in use (``rank: auto`` resolved)."""
        return self.states[0].source.rank

    def projections(self) -> list[tuple[str, Projection]]:
        """Every distinct A once, with the name its seed derives from: a projection shared
        by a group is listed (and so redrawn) once."""
        distinct: dict[int, tuple[str, Projection]] = {}
        for state in self.states:
            distinct.setdefault(id(state.source), (state.projection_name, state.source))
        return list(distinct.values())

    def zero_(self) -> None:
        if self.accumulator is not None:
            self.accumulator.discard()
        self.buffer.zero_()
        for state in self.states:
            state.backward_calls = 0
            if state.shared_input is not None:
                state.shared_input.clear()

    def remove(self) -> None:
        """Remove every hook; weights keep their values and stay frozen."""
        for state in self.states:
            for handle in state.handles:
                handle.remove()
            state.handles.clear()


class _KeepInput(torch.autograd.Function):
    """Identity on the layer input that saves X for the sketch, before the layer's matmul
    (under activation checkpointing). Its own backward only passes the gradient on: the
    output side's ``_AccumulateSketch`` reads X from this node, which is still unrun then."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inputs)
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx: Any, grad_inputs: torch.Tensor) -> torch.Tensor:
        return grad_inputs


_KEPT_INPUT_NODE = _KeepInput._backward_cls


class _AccumulateSketch(torch.autograd.Function):
    """Identity on the layer output whose backward adds dY^T P into the sketch.

    ``saved`` is P itself, or, under activation checkpointing (``autocast`` given), the
    layer input X, projected in backward under the forward's autocast state; X is then
    either ``saved`` or, when ``kept`` is given, the X that ``_KeepInput`` node saved."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, saved: torch.Tensor | None, state: SketchState,
        autocast: AutocastState | None, kept: Any = None,
    ) -> torch.Tensor:
        # Saved through save_for_backward so that autograd frees it right after this node's
        # backward, and activation checkpointing can drop and recompute it.
        ctx.save_for_backward(saved)
        ctx.state = state
        ctx.autocast = autocast
        ctx.kept = kept
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        # _KeepInput's own backward never unpacks X: checkpointing hands each recomputed
        # tensor out once.
        (saved,) = ctx.kept.saved_tensors if ctx.kept is not None else ctx.saved_tensors
        state: SketchState = ctx.state
        if ctx.autocast is None:
            projected = saved
        else:
            with ctx.autocast.restored():
                projected = state.project(saved)
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        if state.accumulator is None:
            add_outer(state.sketch, rows, projected)
        else:
            state.accumulator.add(state, rows, projected)
        state.backward_calls += 1
        return grad_output, None, None, None, None


def add_outer(sketch: torch.Tensor, grad_rows: torch.Tensor, projected: torch.Tensor) -> None:
    """sketch += grad_rows^T @ projected, accumulated in float32."""
    if grad_rows.dtype == sketch.dtype and projected.dtype == sketch.dtype:
        sketch.addmm_(grad_rows.T, projected)
    else:
        sketch.addmm_(grad_rows.T.to(sketch.dtype), projected.to(sketch.dtype))


def _keep_input_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Under activation checkpointing, save X before the matmul (see the module docstring).
    An input that needs no grad gets no autograd node: ``_sketch_hook`` saves X itself."""
    inputs = linear_input(args, kwargs)
    if not torch.is_grad_enabled() or not inputs.requires_grad or not under_activation_checkpointing():
        return None
    if args:
        return (_KeepInput.apply(inputs), *args[1:]), kwargs
    return args, {**kwargs, "input": _KeepInput.apply(inputs)}


def _sketch_hook(state: SketchState):
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor,
    ) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        inputs = linear_input(args, kwargs)
        if not output.requires_grad:
            # Frozen weight and an input that needs no grad (first layer, frozen
            # embeddings): anchor the output here so backward still reaches this layer,
            # without paying for input gradients below the first target.
            output = output.detach().requires_grad_(True)
        if under_activation_checkpointing():
            # This pass's saved tensors are dropped (forward) or kept for backward
            # (recompute): X is saved in both (by _keep_input_hook when it could), and
            # projected once, in backward.
            autocast = AutocastState.current(inputs.device.type)
            if type(inputs.grad_fn) is _KEPT_INPUT_NODE:
                return _AccumulateSketch.apply(output, None, state, autocast, inputs.grad_fn)
            return _AccumulateSketch.apply(output, inputs.detach(), state, autocast)
        return _AccumulateSketch.apply(output, state.project(inputs), state, None)

    return hook


def is_target_name(name: str, target_modules: list[str] | tuple[str, ...]) -> bool:
    """A module is a target when the last component of its qualified name is listed."""
    return name.rsplit(".", 1)[-1] in target_modules


def find_targets(model: nn.Module, target_modules: list[str] | tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """The (canonical name, module) of every target, in module order.

    A target must be a dense ``nn.Linear``; anything else matching a target name is a
    ``TypeError``. No match at all is a ``ValueError``.
    """
    found: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if not is_target_name(name, target_modules):
            continue
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"LoGRA target {name!r} is a {type(module).__name__}, not a dense nn.Linear; "
                "remove it from target_modules or target its Linear submodules"
            )
        if not module.weight.is_floating_point():
            raise TypeError(f"LoGRA target {name!r} has a {module.weight.dtype} weight; only dense float weights can be trained")
        found.append((canonical_name(name), module))
    if not found:
        raise ValueError(
            f"no module of {type(model).__name__} matches target_modules={list(target_modules)}; "
            "name the last component of the Linear layers to train (e.g. 'q_proj')"
        )
    return found


def install_sketches(
    model: nn.Module,
    config: LoGRAConfig,
    *,
    compute_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    update: int = 0,
) -> SketchSet:
    """Freeze every target weight and hook it so that backward accumulates its sketch.

    ``compute_dtype`` is the dtype the layers compute in (default: the weight dtype); the
    projections are stored in it when that is exact, else in float32. The model's
    ``state_dict`` keys are unchanged: nothing is registered as a parameter or buffer.
    ``config.rank`` may be ``"auto"``: it resolves from the targets' input widths
    (``projection.auto_rank``) and ``SketchSet.rank`` holds the result; ``config`` itself
    is not changed here (``LoGRAOptimizer`` writes the resolved rank back). With
    ``config.share_projection_by_input`` the members of each ``projection_groups`` group
    hold one A, seeded from the group's first member's canonical name (so that member's A
    is the one it would draw alone). With ``config.regenerate_projections`` no A is kept:
    each use draws it again from its seed.
    """
    targets = find_targets(model, config.target_modules)
    rank = resolve_rank(config.rank, [module.in_features for _, module in targets])
    sizes = [module.out_features * rank for _, module in targets]
    first_weight = targets[0][1].weight
    device = torch.device(device) if device is not None else _local_device(first_weight)
    groups = projection_groups(targets) if config.share_projection_by_input else [[i] for i in range(len(targets))]
    drawn: dict[int, tuple[Projection, str, SharedProjectedInput | None]] = {}
    for members in groups:
        name, module = targets[members[0]]
        dtype = projection_storage_dtype(rank, config.distribution, compute_dtype or module.weight.dtype)
        seed = projection_seed(config.seed, update if config.redraw_projections else 0, name)
        projection = Projection.draw(rank, module.in_features, seed, device=device, dtype=dtype,
                                     distribution=config.distribution, regenerate=config.regenerate_projections)
        shared = SharedProjectedInput(len(members)) if len(members) > 1 else None
        for index in members:
            drawn[index] = (projection, name, shared)
    buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    states: list[SketchState] = []
    offset = 0
    for index, ((name, module), size) in enumerate(zip(targets, sizes)):
        module.weight.requires_grad_(False)
        projection, projection_name, shared = drawn[index]
        state = SketchState(
            name=name,
            module=module,
            source=projection,
            sketch=buffer[offset : offset + size].view(module.out_features, rank),
            second_moment=torch.zeros(module.out_features, 1, dtype=torch.float32, device=device),
            projection_name=projection_name,
            shared_input=shared,
        )
        state.handles.append(module.register_forward_pre_hook(_keep_input_hook, with_kwargs=True))
        state.handles.append(module.register_forward_hook(_sketch_hook(state), with_kwargs=True))
        states.append(state)
        offset += size
    return SketchSet(states=states, buffer=buffer)


def remove_sketches(sketches: SketchSet) -> None:
    sketches.remove()


def _local_device(weight: torch.Tensor) -> torch.device:
    device = weight.device
    if device.type == "meta":
        raise ValueError("cannot install sketches on a meta-device model; materialise the weights first")
    return device
