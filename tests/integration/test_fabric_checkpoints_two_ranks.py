"""fabric.save / fabric.load with strategy="logra_fsdp" on two processes: a run resumes
bit-identically, and a checkpoint moves between 1 process (plain weights) and 2 (FSDP2 shards)."""

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.lightning import FABRIC_STEPS, assert_identical, fabric_run


def _save_then_resume(rank, world, folder):
    uninterrupted = fabric_run(world, FABRIC_STEPS)
    fabric_run(world, FABRIC_STEPS // 2, save_to=Path(folder) / "ckpt")
    resumed = fabric_run(world, FABRIC_STEPS, load_from=Path(folder) / "ckpt")
    return uninterrupted, resumed


def _load_on_two_then_save(rank, world, folder):
    return fabric_run(world, FABRIC_STEPS // 2, load_from=Path(folder) / "one", save_to=Path(folder) / "two")


@pytest.mark.distributed
def test_two_process_fabric_save_and_load_resume_bit_identically(tmp_path):
    for uninterrupted, resumed in run_lightning_on_two_ranks(_save_then_resume, str(tmp_path)):
        assert_identical(uninterrupted, resumed)


@pytest.mark.distributed
def test_a_checkpoint_moves_between_one_and_two_processes(tmp_path):
    saved = fabric_run(1, FABRIC_STEPS // 2, save_to=tmp_path / "one")
    on_two = run_lightning_on_two_ranks(_load_on_two_then_save, str(tmp_path))
    back_on_one = fabric_run(1, FABRIC_STEPS // 2, load_from=tmp_path / "two")
    for loaded in [*on_two, back_on_one]:
        assert loaded["counters"] == saved["counters"] and loaded["counters"][0] == FABRIC_STEPS // 2
        for a, b in zip(loaded["weights"] + loaded["moments"], saved["weights"] + saved["moments"]):
            assert torch.equal(a, b)
