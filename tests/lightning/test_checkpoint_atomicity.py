"""Crash-consistent checkpoint folders (issue 23 items 5 and 6): a save stopped between any
two file operations resumes from a complete checkpoint, temporary names match none of
Lightning's checkpoint patterns, and ``weights_only`` reaches ``torch.load``. (One writer per
folder: test_writer_lock.py.)"""

import pickle
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch.distributed.checkpoint.api import CheckpointException

from lightning_logra import LoGRAFSDPStrategy
from lightning_logra.strategies.checkpoints import atomic, writer_lock
from tests.helpers.lightning import FABRIC_STEPS, CausalLM, assert_identical, config, fabric_run, loader, trainer


class Killed(BaseException):
    """A stand-in for kill -9: no handler of the code under test catches it."""


def kill_at_operation(monkeypatch, operation_index):
    """Raise ``Killed`` instead of the file operation number ``operation_index`` (0-based)
    among renames (DCP's, the marker's, the protocol's) and folder deletions."""
    count = {"done": 0}

    def counted(real):
        def operation(*args, **kwargs):
            if count["done"] == operation_index:
                raise Killed
            count["done"] += 1
            return real(*args, **kwargs)
        return operation

    monkeypatch.setattr(Path, "rename", counted(Path.rename))
    monkeypatch.setattr(atomic, "shutil", SimpleNamespace(rmtree=counted(shutil.rmtree)))
    return count


def test_a_save_stopped_between_any_two_file_operations_resumes_to_the_same_weights(tmp_path, monkeypatch):
    uninterrupted = fabric_run(1, FABRIC_STEPS)
    checkpoint = tmp_path / "last.ckpt"
    fabric_run(1, 2, save_to=checkpoint)  # the complete checkpoint the next save replaces
    operation = 0
    while True:
        with monkeypatch.context() as patch:
            count = kill_at_operation(patch, operation)
            try:
                fabric_run(1, 3, save_to=checkpoint, load_from=checkpoint)
                finished = True
            except (Killed, CheckpointException):  # DCP re-raises what stopped its own rename
                finished = False
        resumed = fabric_run(1, FABRIC_STEPS, load_from=checkpoint)
        assert_identical(uninterrupted, resumed)
        assert [p.name for p in tmp_path.iterdir() if p.name != writer_lock.LOCK_NAME] == ["last.ckpt"], operation
        if finished:
            break
        operation += 1
    assert count["done"] >= 5  # DCP's metadata rename (weights), the marker, three protocol steps


@pytest.mark.parametrize("interrupted_after", ["marker", "retire"])
def test_start_up_puts_back_the_checkpoint_a_crash_left_between_the_renames(tmp_path, interrupted_after):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.mkdir()
    (checkpoint / "step").write_text("1")
    partial = atomic.prepare(checkpoint)
    partial.mkdir()
    (partial / "step").write_text("2")
    atomic._write_marker(partial, checkpoint.name)
    if interrupted_after == "retire":  # the state of the issue: no last.ckpt at all
        atomic._write_marker(checkpoint, checkpoint.name)
        checkpoint.rename(atomic.old_path(checkpoint))
    assert atomic.recover_folder(tmp_path) == ([checkpoint] if interrupted_after == "retire" else [])
    assert (checkpoint / "step").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_without_a_complete_partial_the_retired_checkpoint_is_restored(tmp_path):
    checkpoint = tmp_path / "hpc_ckpt_1.ckpt"
    old = atomic.old_path(checkpoint)
    old.mkdir()
    atomic._write_marker(old, checkpoint.name)
    atomic.partial_path(checkpoint).mkdir()  # never marked complete
    assert atomic.recover_folder(tmp_path) == [checkpoint]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt"]


def test_temporary_names_match_no_lightning_checkpoint_pattern(tmp_path):
    for name in ("hpc_ckpt_1.ckpt", "last.ckpt"):
        (tmp_path / name).mkdir()
    for name in ("hpc_ckpt_2.ckpt", "last-v1.ckpt", "last.ckpt"):
        for leftover in (atomic.partial_path(tmp_path / name), atomic.old_path(tmp_path / name)):
            leftover.mkdir()
    (tmp_path / writer_lock.LOCK_NAME).write_text("{}")
    assert _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_") == 1
    last = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer=None)
    assert last == {str(tmp_path / "last.ckpt")}


def test_a_legacy_partial_folder_is_refused_naming_both_copies(tmp_path):
    for name in ("last.ckpt.partial", "last.ckpt.old"):
        (tmp_path / name / "logra").mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"last\.ckpt\.partial and .*last\.ckpt\.old .*is missing"):
        atomic.recover_folder(tmp_path)


def test_a_removal_stopped_midway_never_brings_the_checkpoint_back(tmp_path, monkeypatch):
    checkpoint = tmp_path / "epoch=0.ckpt"
    (checkpoint / "logra").mkdir(parents=True)
    with monkeypatch.context() as patch:
        kill_at_operation(patch, 1)  # after the rename, before the deletion
        with pytest.raises(Killed):
            atomic.remove(checkpoint)
    assert not checkpoint.exists()
    assert atomic.recover_folder(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


class PicklingCheckpoint(CausalLM):
    """Puts an arbitrary Python object into the checkpoint's metadata."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["opaque"] = SimpleNamespace(note="not a tensor")


def test_the_trainer_strategy_passes_weights_only_to_torch_load(tmp_path):
    strategy = LoGRAFSDPStrategy(logra=config())
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=2, tmp_path=tmp_path, callbacks=callbacks,
                enable_checkpointing=True).fit(PicklingCheckpoint(), loader(16))
    checkpoint = next((tmp_path / "ckpt").iterdir())
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        strategy.load_checkpoint(checkpoint, weights_only=True)
    assert strategy.load_checkpoint(checkpoint, weights_only=False)["opaque"].note == "not a tensor"
