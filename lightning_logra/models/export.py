"""Export a trained policy from a training checkpoint as a plain Hugging Face folder.

A checkpoint holds the whole LightningModule: its policy under ``policy.``, maybe a frozen
``reference.`` copy (``kl_coef > 0``), optimizer state and, for ``logra_fsdp``, LoGRA's
sketches. Users want the policy alone, loadable with ``from_pretrained`` and servable by
vLLM, so the export rebuilds the skeleton GRPOModule was built from (its saved
hyper-parameters ``model`` and ``lora``), loads the policy weights into it, merges LoRA
adapters into the base weights, and writes ``save_pretrained`` folders of model and tokenizer.

Two checkpoint formats are read:

* a ``logra_fsdp`` checkpoint folder (DCP shards plus Lightning's ``meta.pt``), written by
  one process (plain tensors) or several (FSDP2 shards); DCP loads either into full tensors
  in this one process, without a process group;
* a Lightning ``.ckpt`` file (Lightning's default strategy, e.g. dense AdamW or LoRA runs).

Both hold pickled Python objects (Lightning's metadata: loops, callbacks, the
hyper-parameters' config dataclasses), so they are loaded with ``weights_only=False``:
export only checkpoints you (or someone you trust) wrote, as unpickling can run code.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

from lightning_logra.models.loading import BUILTIN_MODELS, builtin_model_dir, load_policy, with_lora

POLICY_PREFIX = "policy."  # GRPOModule keeps its policy in ``self.policy``
DCP_PREFIX = "state_dict."  # the logra_fsdp strategies save the module state under "state_dict"


@dataclass(frozen=True)
class ExportedModel:
    """What ``export_checkpoint`` wrote, for a one-line report."""

    path: Path
    parameters: int
    lora_merged: bool

    def summary(self) -> str:
        how = "LoRA adapters merged into the base weights" if self.lora_merged else "no LoRA to merge"
        return f"Exported {self.parameters:,} parameters to {self.path} ({how})"


def export_checkpoint(
    ckpt_path: str | Path,
    out_dir: str | Path,
    *,
    model: str | None = None,
    overwrite: bool = False,
) -> ExportedModel:
    """Write the policy of the checkpoint ``ckpt_path`` as a Hugging Face folder ``out_dir``
    (``config.json``, safetensors weights, ``generation_config.json`` where the model has one,
    tokenizer files), LoRA adapters merged in.

    The skeleton is built with ``load_policy`` from the checkpoint's ``model``
    hyper-parameter, or from ``model`` when given (a checkpoint whose model folder moved, or
        a module that saved no hyper-parameters). Weights keep the checkpoint's dtype. The folder
    is written beside ``out_dir`` and renamed into place, so a failed export leaves nothing
    that looks complete. An existing non-empty ``out_dir`` is written into only with
    ``overwrite``, and then only the files the export writes are replaced (plus weight files
    of another layout, which would be loaded with or instead of the new ones); its other
    files stay. Refused before any work: a symbolic link, a folder holding the checkpoint, and
    the folder the run built its model from (a later run would load the trained weights as
    its base model and its KL reference).
    """
    checkpoint = open_checkpoint(Path(ckpt_path))
    out = Path(out_dir)
    _check_destination(out, checkpoint.path, overwrite)
    hyper_parameters = checkpoint.hyper_parameters()
    source = model or _recorded_model(hyper_parameters, checkpoint.path)
    for read_from in {source, hyper_parameters.get("model")} - {None}:
        _check_not_a_model_folder(out, str(read_from), hyper_parameters.get("cache_dir"))
    policy, tokenizer = load_policy(source, dtype=checkpoint.dtype(), cache_dir=hyper_parameters.get("cache_dir"))
    lora = hyper_parameters.get("lora")
    if lora is not None:
        policy = with_lora(policy, lora)
    checkpoint.load_into(policy, source)
    if lora is not None:
        policy = policy.merge_and_unload()
    _write_folder(out, policy, tokenizer)
    return ExportedModel(out, sum(p.numel() for p in policy.parameters()), lora_merged=lora is not None)


def open_checkpoint(path: Path) -> DCPCheckpoint | LightningFileCheckpoint:
    """The reader for ``path``: a logra_fsdp checkpoint folder or a Lightning ``.ckpt`` file."""
    if path.is_dir():
        if not (path / _METADATA_FILENAME).is_file() or not (path / ".metadata").is_file():
            raise ValueError(
                f"{path} is not a checkpoint: a logra_fsdp checkpoint folder holds {_METADATA_FILENAME} and "
                "DCP's .metadata; pass a folder the Trainer's ModelCheckpoint wrote (e.g. ckpt/epoch=0-step=10.ckpt)"
            )
        return DCPCheckpoint(path)
    if path.is_file():
        return LightningFileCheckpoint(path)
    raise FileNotFoundError(f"checkpoint {path} does not exist; pass the path ModelCheckpoint wrote")


class DCPCheckpoint:
    """A logra_fsdp checkpoint folder, read in one process whatever number of ranks wrote it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        self._saved = {
            name[len(DCP_PREFIX) + len(POLICY_PREFIX):]: meta
            for name, meta in saved.items()
            if name.startswith(DCP_PREFIX + POLICY_PREFIX) and isinstance(meta, dcp.TensorStorageMetadata)
        }
        _require_policy_weights(self._saved, path)

    def hyper_parameters(self) -> dict[str, Any]:
        # Lightning's metadata is pickled Python objects (see the module docstring).
        metadata = _unpickle(self.path / _METADATA_FILENAME)
        return dict(metadata.get("hyper_parameters") or {})

    def dtype(self) -> torch.dtype:
        return _first_floating_dtype([meta.properties.dtype for meta in self._saved.values()])

    def load_into(self, policy: nn.Module, source: str) -> None:
        """DCP reads each weight's shards, whichever ranks wrote them, into the full tensor."""
        targets = _checked_targets(policy, {name: tuple(meta.size) for name, meta in self._saved.items()},
                                   self.path, source)
        request = {DCP_PREFIX.rstrip("."): {POLICY_PREFIX + name: tensor for name, tensor in targets.items()}}
        with warnings.catch_warnings():
            # DCP warns that it reads in a single process even when asked to: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(request, checkpoint_id=self.path, no_dist=True)


class LightningFileCheckpoint:
    """A Lightning ``.ckpt`` file (``torch.save`` of the checkpoint dict)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            loaded = _unpickle(path, map_location="cpu", mmap=True)  # mmap: only the policy's weights are read
        except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
            raise ValueError(f"{path} is not a checkpoint: torch.load cannot read it ({error})") from error
        if not isinstance(loaded, Mapping) or not isinstance(loaded.get("state_dict"), Mapping):
            raise ValueError(f"{path} is not a Lightning checkpoint: it holds no 'state_dict'; "
                             "pass a .ckpt the Trainer wrote")
        self._checkpoint = loaded
        self._saved = {
            name[len(POLICY_PREFIX):]: tensor
            for name, tensor in loaded["state_dict"].items()
            if name.startswith(POLICY_PREFIX)
        }
        _require_policy_weights(self._saved, path)

    def hyper_parameters(self) -> dict[str, Any]:
        return dict(self._checkpoint.get("hyper_parameters") or {})

    def dtype(self) -> torch.dtype:
        return _first_floating_dtype([tensor.dtype for tensor in self._saved.values()])

    def load_into(self, policy: nn.Module, source: str) -> None:
        targets = _checked_targets(policy, {name: tuple(t.shape) for name, t in self._saved.items()}, self.path, source)
        for name, tensor in targets.items():
            tensor.copy_(self._saved[name])


def _unpickle(path: Path, **options: Any) -> Any:
    """``torch.load`` of pickled Python objects (see the module docstring), which need the
    classes they were written with."""
    try:
        return torch.load(path, weights_only=False, **options)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{path} names classes this Python cannot import ({error}); run the export where "
                         "the training code is importable") from error


def _require_policy_weights(saved: Mapping[str, Any], path: Path) -> None:
    if not saved:
        raise ValueError(
            f"{path} holds no policy weights (no state_dict key starts with {POLICY_PREFIX!r}): export reads "
            "checkpoints of modules that keep their model in `self.policy`, as GRPOModule does"
        )


def _first_floating_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype the policy was trained in (its first floating weight's), to build the skeleton in."""
    return next((dtype for dtype in dtypes if dtype.is_floating_point), torch.float32)


def _checked_targets(policy: nn.Module, saved: dict[str, tuple[int, ...]], path: Path,
                     source: str) -> dict[str, torch.Tensor]:
    """The skeleton's state-dict tensors (sharing storage with its weights) to load from the
    checkpoint, once both sides agree on every name and shape. Tied weights (a head sharing
    the embedding) need only one of their names in the checkpoint."""
    state = policy.state_dict()
    hint = "pass --model / model= with the model that was trained, and keep the checkpoint's lora setting"
    unexpected = sorted(set(saved) - set(state))
    if unexpected:
        raise ValueError(f"{path} holds policy weight {POLICY_PREFIX}{unexpected[0]!r}, which the skeleton built "
                         f"from {source!r} lacks ({len(unexpected)} such weights); {hint}")
    for name, tensor in state.items():
        if name in saved and tuple(tensor.shape) != saved[name]:
            raise ValueError(f"{path}: policy weight {name!r} has shape {saved[name]}, the skeleton built from "
                             f"{source!r} {tuple(tensor.shape)}; {hint}")
    loaded_storage = {state[name].data_ptr() for name in saved}
    missing = [name for name, tensor in state.items() if name not in saved and tensor.data_ptr() not in loaded_storage]
    if missing:
        raise ValueError(f"{path} lacks policy weight {POLICY_PREFIX}{missing[0]!r} of the skeleton built from "
                         f"{source!r} ({len(missing)} missing); {hint}")
    return {name: state[name] for name in saved}


def _recorded_model(hyper_parameters: dict[str, Any], path: Path) -> str:
    """The ``model`` hyper-parameter GRPOModule saved, checked to still exist if it is a path."""
    recorded = hyper_parameters.get("model")
    if not isinstance(recorded, str):
        raise ValueError(
            f"{path} records no 'model' hyper-parameter (its module did not call save_hyperparameters with "
            "one, as GRPOModule does); pass --model / model= with the hub id or folder the policy was built from"
        )
    if os.path.isabs(recorded) and not Path(recorded).exists():
        raise FileNotFoundError(
            f"the model folder {recorded} recorded in {path} no longer exists; "
            "pass --model / model= with where it is now"
        )
    return recorded


def _check_destination(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse before any work: a symbolic link, a file, a non-empty folder (unless
    ``overwrite``), or a folder holding the checkpoint itself."""
    if out.is_symlink():
        raise ValueError(f"--out / out_dir {out} is a symbolic link (to {os.readlink(out)}); pass the folder itself")
    if out.is_file():
        raise FileExistsError(f"--out / out_dir {out} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out / out_dir {out} exists and is not empty; pass another folder, "
                                  "or --overwrite / overwrite=True to write the exported files into it")
        if checkpoint.resolve().is_relative_to(out.resolve()):
            raise ValueError(f"--out / out_dir {out} holds the checkpoint {checkpoint}: "
                             "writing there could damage the checkpoint")


def _check_not_a_model_folder(out: Path, model: str, cache_dir: str | None) -> None:
    """Refuse to write into the folder a run builds its model from."""
    folder = builtin_model_dir(model.lower(), cache_dir) if model.lower() in BUILTIN_MODELS else Path(model)
    if not folder.is_dir():
        return  # a hub id: the hub's cache is not a place users export to
    if out.resolve() == folder.resolve():
        raise ValueError(
            f"--out / out_dir {out} is where the run reads its model from ({folder}); exporting there would "
            "replace the base model, and a later run (its kl_coef > 0 reference too) would start from the "
            "trained weights; pass another folder"
        )


# Files that hold weights: one left from another layout (sharded vs single file,
# safetensors vs .bin) would be loaded with or instead of the exported weights.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")


def _write_folder(out: Path, policy: nn.Module, tokenizer: Any) -> None:
    """``save_pretrained`` into a sibling folder, then renamed into place (a new or empty
    ``out``) or its files moved into ``out`` one by one (``overwrite`` of a non-empty one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}")
    try:
        policy.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if out.is_dir() and any(out.iterdir()):
            _replace_files(partial, out)
        else:
            if out.exists():
                out.rmdir()
            partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _replace_files(written: Path, out: Path) -> None:
    names = {path.name for path in written.iterdir()}
    for pattern in WEIGHT_FILES:
        for stale in out.glob(pattern):
            if stale.name not in names:
                stale.unlink()
    for name in sorted(names):
        os.replace(written / name, out / name)  # each file atomically; a file of out's own stays
