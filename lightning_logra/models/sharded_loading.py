"""Build a policy empty (meta device) and fill each rank's own rows from its safetensors files.

A 27B-class model is 108 GB in float32: loading it whole on every rank before FSDP2 shards
it would need that much host memory per rank. Instead the model is built on the meta device
(no storage), sharded, and only then given storage: each parameter's local shard is a range
of rows (FSDP2 shards dim 0), read with ``safe_open(...).get_slice(name)[rows]`` straight
from the files and converted to the parameter's dtype, which is what ``from_pretrained``
does row by row (so the values are bit for bit the same). On one device the "shard" is the
whole tensor: one full load.

Tied weights (a head that is the embedding) stay one parameter; non-persistent buffers
(rotary frequencies) are computed by the model's own ``_init_weights``, as
``from_pretrained`` computes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def empty_policy(source: str, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The causal LM of ``source`` (a folder, or a hub name: its config and safetensors files
    are fetched into the hub cache) on the meta device (no storage) in ``dtype``, with its
    generation config and ``name_or_path`` (the folder) set as ``from_pretrained`` sets them:
    ``fill_from_safetensors`` reads its weights from there once it is sharded."""
    source = local_folder(source)
    safetensors_files(source)  # fail here, not after sharding, when there is nothing to read
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.name_or_path = model.config._name_or_path = str(source)
    if (Path(source) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    return model


def local_folder(source: str) -> str:
    """``source`` if it is a folder, else the hub-cache folder of the hub model ``source``
    with its JSON and safetensors files (downloaded once, shared by the ranks of a machine)."""
    if Path(source).is_dir():
        return str(source)
    from huggingface_hub import snapshot_download

    return snapshot_download(source, allow_patterns=["*.json", "*.safetensors"])


@torch.no_grad()
def materialize(model: PreTrainedModel, device: torch.device | str = "cpu") -> None:
    """Storage on ``device`` for the empty ``model``: its weights from the safetensors files of
    ``model.name_or_path`` when it names a folder that has them (``fill_from_safetensors``),
    else the model's own random initialisation (a model built from a config)."""
    folder = Path(model.name_or_path or "")
    if model.name_or_path and ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()):
        fill_from_safetensors(model, device)
        return
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights()


def is_empty(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def safetensors_files(source: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of the folder ``source`` that holds it (one
    ``model.safetensors``, or the shards a ``model.safetensors.index.json`` lists)."""
    folder = Path(source)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise FileNotFoundError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}: no safetensors weights to load")


@torch.no_grad()
def fill_from_safetensors(model: PreTrainedModel, device: torch.device | str = "cpu") -> None:
    """Give the empty (meta) ``model`` storage on ``device`` and fill it from the safetensors
    files of ``model.name_or_path``: each parameter's local rows only (a FSDP2 shard, or the
    whole tensor when not sharded), in the parameter's dtype."""
    source = model.name_or_path
    files = safetensors_files(source)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each holder of a shared parameter its own copy
    targets = model.state_dict(keep_vars=True)
    missing = [name for name in targets if name not in files and not _is_tied_copy(model, name)]
    if missing:
        raise KeyError(f"{source}: no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in names:
                _fill(targets[name], handle.get_slice(name), name, source)
    _compute_non_persistent_buffers(model)


def _fill(target: torch.Tensor, stored, name: str, source: str) -> None:
    """Copy the rows of ``stored`` (a safetensors slice) that ``target``'s local shard holds."""
    local, offset = _local_rows(target)
    shape = tuple(stored.get_shape())
    if shape != tuple(target.shape):
        raise ValueError(f"{source}: {name} is stored with shape {shape}, the model expects {tuple(target.shape)}")
    if local.numel():
        rows = stored[offset : offset + local.shape[0]] if local.dim() else stored[:]
        local.copy_(rows.to(local.dtype))


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local tensor of a (possibly FSDP2-sharded) parameter and the global row it starts at."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor.data, 0
    local = tensor.to_local()
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offsets[1:]):
        raise ValueError(f"only row (dim 0) shards can be filled from safetensors; got placements {tensor.placements}")
    return local, offsets[0] if offsets else 0


def _is_tied_copy(model: PreTrainedModel, name: str) -> bool:
    """Whether ``name`` (e.g. ``lm_head.weight``) is tied to another weight the files hold."""
    return name in getattr(model, "all_tied_weights_keys", {}) or (
        getattr(model.config, "tie_word_embeddings", False) and name.endswith("lm_head.weight"))


def _compute_non_persistent_buffers(model: PreTrainedModel) -> None:
    """Rotary frequencies and other non-persistent buffers, computed by the model's own
    ``_init_weights`` (as ``from_pretrained`` does), only on modules without parameters:
    there it cannot draw random weights over loaded ones."""
    non_persistent = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    for module_name in sorted(non_persistent):
        module = model.get_submodule(module_name)
        if next(module.parameters(recurse=False), None) is None:
            model._init_weights(module)
