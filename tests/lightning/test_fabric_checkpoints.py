"""fabric.save / fabric.load with strategy="logra_fsdp": one checkpoint format with the
Trainer (LoGRA's state as tensors in <checkpoint>/logra), written atomically, resumed
bit-identically (with 2 processes, and moved between 1 and 2:
tests/integration/test_fabric_checkpoints_two_ranks.py)."""

import warnings

import lightning as L
import pytest
import torch

from lightning_logra import LoGRAFabricStrategy
from lightning_logra.strategies.runtime import LOGRA_FOLDER
from tests.helpers.lightning import FABRIC_STEPS, ProbedLM, assert_identical, config, fabric_run, trained_weights


def test_fabric_save_and_load_resume_bit_identically(tmp_path):
    uninterrupted = fabric_run(1, FABRIC_STEPS)
    fabric_run(1, FABRIC_STEPS // 2, save_to=tmp_path / "ckpt")
    folder = tmp_path / "ckpt"
    assert (folder / LOGRA_FOLDER / ".metadata").is_file() and (folder / "meta.pt").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the .partial folder was renamed into place
    # LoGRA's state is DCP tensors only: no pickled metadata file to unpickle on load
    assert {".distcp" if p.suffix == ".distcp" else p.name for p in (folder / LOGRA_FOLDER).iterdir()} == {".metadata", ".distcp"}
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
