"""A LoGRA checkpoint folder, written and read with public torch APIs only.

The folder holds DCP shards of the modules' and optimizers' state dicts, Lightning's
metadata file (``meta.pt``) with everything else, and LoGRA's own state in
``logra/state.safetensors`` (see ``logra_state``). ``torch.distributed.checkpoint.state_dict`` handles
FSDP2-sharded and plain modules alike and DCP reshards on load, so a checkpoint written
on one device (plain weights) loads on several (FSDP2) and the other way round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

# Each rank's shards go to the CPU as DCP writes them: saving takes no accelerator memory.
SAVE_OPTIONS = StateDictOptions(cpu_offload=True)


def split_state(state: dict[str, Any], owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state``'s modules and optimizers as state dicts (for DCP), apart from the rest
    (the metadata; ``Stateful`` objects as their ``state_dict()``)."""
    modules = _modules_of(state)
    tensors: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            tensors[key] = get_model_state_dict(value, options=SAVE_OPTIONS)
        elif isinstance(value, Optimizer):
            model = _model_of(value, key, modules, owner)
            tensors[key] = get_optimizer_state_dict(model, value, options=SAVE_OPTIONS)
        else:
            metadata[key] = value.state_dict() if isinstance(value, Stateful) else value
    return tensors, metadata


def save_folder(folder: Path, tensors: dict[str, Any], metadata: dict[str, Any], *, rank: int) -> None:
    """Every rank writes its shards of ``tensors``; rank 0 writes ``metadata``."""
    dcp.save(tensors, checkpoint_id=folder)
    if rank == 0:
        torch.save(metadata, folder / _METADATA_FILENAME)


def require_folder(path: Path, owner: str) -> None:
    if not (path / _METADATA_FILENAME).is_file():
        raise ValueError(
            f"{owner}: {path} is not a LoGRA checkpoint folder (no {_METADATA_FILENAME}); "
            "pass a folder written by the logra_fsdp strategies' save"
        )


def load_folder(folder: Path, state: dict[str, Any], *, strict: bool, weights_only: bool | None,
                owner: str) -> dict[str, Any]:
    """Load ``state``'s modules and optimizers in place and its other keys from the
    metadata (``Stateful`` objects through ``load_state_dict``); return the metadata that
    ``state`` did not ask for. With ``strict=False`` what the checkpoint lacks is kept."""
    modules = _modules_of(state)
    optimizers = {key: (value, _model_of(value, key, modules, owner))
                  for key, value in state.items() if isinstance(value, Optimizer)}
    # Templates in this run's layout: DCP reads into them whatever layout wrote the shards.
    tensors = {key: get_model_state_dict(module) for key, module in modules.items()}
    tensors.update({key: get_optimizer_state_dict(model, optimizer) for key, (optimizer, model) in optimizers.items()})
    dcp.load(tensors, checkpoint_id=folder, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    for key, module in modules.items():
        set_model_state_dict(module, tensors[key], options=StateDictOptions(strict=strict))
    for key, (optimizer, model) in optimizers.items():
        set_optimizer_state_dict(model, optimizer, tensors[key])
    metadata = torch.load(folder / _METADATA_FILENAME, weights_only=weights_only)
    _restore_metadata(state, metadata, strict=strict, owner=owner)
    return metadata


def _restore_metadata(state: dict[str, Any], metadata: dict[str, Any], *, strict: bool, owner: str) -> None:
    requested = [key for key, value in state.items() if not isinstance(value, (nn.Module, Optimizer))]
    missing = [key for key in requested if key not in metadata]
    if strict and missing:
        raise KeyError(f"{owner}: the checkpoint has no {missing[0]!r}; load with strict=False to keep its current value")
    for key in requested:
        if key not in metadata:
            continue
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)


def _modules_of(state: dict[str, Any]) -> dict[str, nn.Module]:
    return {key: value for key, value in state.items() if isinstance(value, nn.Module)}


def _model_of(optimizer: Optimizer, key: str, modules: dict[str, nn.Module], owner: str) -> nn.Module:
    """The module in ``state`` that holds every parameter ``optimizer`` steps: its state
    dict names the optimizer's state by that module's parameter names."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if stepped <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(
        f"{owner}: optimizer {key!r} steps parameters of no module in the checkpoint state; "
        f"put the model it optimizes in the state too, e.g. {{'model': model, {key!r}: optimizer}}"
    )
