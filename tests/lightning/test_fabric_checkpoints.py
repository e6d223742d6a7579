"""fabric.save / fabric.load with strategy="logra_fsdp": one checkpoint format with the
Trainer (LoGRA's state in <checkpoint>/logra/state.safetensors, read without unpickling
anything), written atomically, resumed
bit-identically (with 2 processes, and moved between 1 and 2:
tests/integration/test_fabric_checkpoints_two_ranks.py)."""

import pickle
import shutil
import warnings

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_logra import LoGRAFabricStrategy
from lightning_logra.strategies import convert_legacy_state
from lightning_logra.strategies.checkpoints.logra_state import STATE_FILE, STATE_FOLDER
from tests.helpers.lightning import FABRIC_STEPS, ProbedLM, assert_identical, config, fabric_run, trained_weights


def test_fabric_save_and_load_resume_bit_identically(tmp_path):
    uninterrupted = fabric_run(1, FABRIC_STEPS)
    fabric_run(1, FABRIC_STEPS // 2, save_to=tmp_path / "ckpt")
    folder = tmp_path / "ckpt"
    assert (folder / "meta.pt").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the .partial folder was renamed into place
    # LoGRA's state is one safetensors file: a JSON header and tensors, no pickle
    assert [p.name for p in (folder / STATE_FOLDER).iterdir()] == [STATE_FILE]
    resumed = fabric_run(1, FABRIC_STEPS, load_from=folder)
    assert_identical(uninterrupted, resumed)


def test_fabric_load_with_another_structure_fails_before_any_weight_changes(tmp_path):
    fabric_run(1, 1, save_to=tmp_path / "ckpt")
    strategy = LoGRAFabricStrategy(logra=config(rank=4))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric.launch()
        model = fabric.setup_module(ProbedLM())
        before = trained_weights(strategy)
        with pytest.raises(ValueError, match="rank: 8 != 4"):
            fabric.load(tmp_path / "ckpt", {"model": model})
    assert all(torch.equal(a, b) for a, b in zip(before, trained_weights(strategy)))


def set_up_strategy():
    """A one-process Fabric run with LoGRA installed, before any step."""
    strategy = LoGRAFabricStrategy(logra=config(kl_control=True, update_ratio=1e-2, kl_budget=1e-4))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric.launch()
        fabric.setup_module(ProbedLM())
    return strategy


def refuse_to_unpickle(*args, **kwargs):
    raise AssertionError("LoGRA's state was read through pickle")


def test_logra_state_is_read_without_unpickling(tmp_path, monkeypatch):
    saved = fabric_run(1, 2, save_to=tmp_path / "ckpt")
    strategy = set_up_strategy()
    for owner, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                        (dcp.FileSystemReader, "read_metadata")]:
        monkeypatch.setattr(owner, name, refuse_to_unpickle)
    state = strategy.runtime.read_state(tmp_path / "ckpt")
    assert state["update_count"].item() == saved["counters"][0] == 2
    assert state["mismatch"].item() == saved["counters"][1]
    for read, written in zip(state["second_moments"].values(), saved["moments"], strict=True):
        assert torch.equal(read, written)


def test_a_state_in_the_dcp_format_is_refused_until_converted(tmp_path):
    uninterrupted = fabric_run(1, FABRIC_STEPS)
    fabric_run(1, FABRIC_STEPS // 2, save_to=tmp_path / "ckpt")
    strategy = set_up_strategy()
    strategy.runtime.load_state(strategy.runtime.read_state(tmp_path / "ckpt"))
    # the same state as lightning-logra wrote it before safetensors: DCP, a pickled .metadata
    legacy = tmp_path / "ckpt" / STATE_FOLDER
    shutil.rmtree(legacy)
    dcp.save({"logra": strategy.logra_optimizer}, checkpoint_id=legacy)
    with pytest.raises(ValueError, match=rf"{legacy}.*\.metadata file is a pickle.*convert_legacy_state"):
        strategy.runtime.read_state(tmp_path / "ckpt")
    convert_legacy_state(tmp_path / "ckpt")
    assert [p.name for p in legacy.iterdir()] == [STATE_FILE]
    assert_identical(uninterrupted, fabric_run(1, FABRIC_STEPS, load_from=tmp_path / "ckpt"))
