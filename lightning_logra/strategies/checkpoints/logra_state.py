"""LoGRA's own state in a checkpoint folder: one safetensors file, ``logra/state.safetensors``.

A safetensors file is a JSON header and raw tensor bytes, so reading it unpickles nothing.
The state is ``LoGRAOptimizer.state_dict()``: tensors only, the configuration and the layer
names among them as UTF-8 JSON bytes. Rank 0 writes every row of every RowAdam moment
(rows sharded over ranks are gathered first: one float per weight row, small); each rank
reads back only the rows it owns in this run, so a state saved on any number of processes
resumes on any other.

Checkpoints of lightning-logra before this format kept the state as a DCP checkpoint in
``logra/``, whose ``.metadata`` file is a pickle: those are refused on load, and
``convert_legacy_state`` rewrites one (unpickling it, so for trusted folders only).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_logra.core.layout import local_row_range

STATE_FOLDER = "logra"
STATE_FILE = "state.safetensors"
LEGACY_METADATA = ".metadata"  # DCP's pickled index: marks a state in the format before this one
LEGACY_PREFIX = "logra."  # the key DCP stored the optimizer's state under


def write_state(folder: Path, state: dict[str, Any], *, rank: int) -> None:
    """Write ``state`` in ``folder``/logra. Every rank calls this (gathering sharded
    moments is a collective, in the same order on every rank); rank 0 writes the file."""
    tensors = {key: _whole_on_cpu(tensor) for key, tensor in _flatten(state).items()}
    if rank == 0:
        location = Path(folder) / STATE_FOLDER
        location.mkdir(parents=True, exist_ok=True)
        save_file(tensors, location / STATE_FILE)


def read_state(folder: Path, template: dict[str, Any]) -> dict[str, Any]:
    """The state saved in ``folder``/logra, in ``template``'s structure (the optimizer's
    own ``state_dict()``): where the template holds a row-sharded DTensor, this rank's rows
    as a plain tensor; everything else as saved, whatever its size now (the JSON bytes)."""
    folder = Path(folder)
    location = folder / STATE_FOLDER
    path = location / STATE_FILE
    if not path.is_file():
        if (location / LEGACY_METADATA).is_file():
            raise ValueError(
                f"{location} holds LoGRA's state in the format of lightning-logra before safetensors "
                f"(a DCP checkpoint whose {LEGACY_METADATA} file is a pickle); it is not read, since that would "
                f"unpickle it. If you trust this checkpoint, convert it once with "
                f"lightning_logra.strategies.convert_legacy_state({str(folder)!r}), then resume"
            )
        raise ValueError(f"{folder} is not a LoGRA checkpoint: it has no LoGRA state ({STATE_FOLDER}/{STATE_FILE})")
    with safe_open(path, framework="pt") as saved:
        stored = set(saved.keys())

        def read(key: str, current: torch.Tensor) -> torch.Tensor:
            if key not in stored:
                raise ValueError(f"{path} has no tensor {key!r}: not the state of this LoGRA optimizer")
            if isinstance(current, DTensor):
                start, stop = local_row_range(current)
                return saved.get_slice(key)[start:stop]
            return saved.get_tensor(key)

        return _map_leaves(template, read)


def convert_legacy_state(folder: str | Path) -> None:
    """Rewrite the LoGRA state of checkpoint ``folder`` from the format before safetensors
    (a DCP checkpoint in ``logra/``) as ``logra/state.safetensors``, then remove the old
    files. This unpickles the old ``.metadata``: run it on checkpoints you trust, in one
    process (no process group needed)."""
    location = Path(folder) / STATE_FOLDER
    if not (location / LEGACY_METADATA).is_file():
        raise ValueError(f"{location} has no {LEGACY_METADATA}: not a LoGRA state in the format before safetensors")
    reader = dcp.FileSystemReader(location)
    saved = reader.read_metadata().state_dict_metadata
    tensors = {fqn: torch.empty(entry.size, dtype=entry.properties.dtype)
               for fqn, entry in saved.items() if isinstance(entry, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    written = location / (STATE_FILE + ".converting")
    save_file({fqn.removeprefix(LEGACY_PREFIX): tensor for fqn, tensor in tensors.items()}, written)
    os.replace(written, location / STATE_FILE)
    for old in location.iterdir():
        if old.name != STATE_FILE:
            old.unlink()


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors as one dict keyed by dotted paths (DCP's names, too)."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _map_leaves(template: dict[str, Any], read: Callable[[str, torch.Tensor], torch.Tensor],
                prefix: str = "") -> dict[str, Any]:
    """``template``'s structure with each tensor replaced by ``read(dotted path, tensor)``;
    the template decides the paths, so names that contain dots stay unambiguous."""
    return {
        key: _map_leaves(value, read, f"{prefix}{key}.") if isinstance(value, dict) else read(f"{prefix}{key}", value)
        for key, value in template.items()
    }


def _whole_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """Every row, as a CPU tensor of its own (safetensors refuses tensors sharing memory)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu").clone(memory_format=torch.contiguous_format)
