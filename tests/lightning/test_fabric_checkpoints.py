"""fabric.save / fabric.load with strategy="logra_fsdp": one checkpoint format with the
Trainer (LoGRA's state as tensors in <checkpoint>/logra), written atomically, resumed
bit-identically with 1 and 2 processes, and moved between 1 process (plain weights) and 2
(FSDP2 shards)."""

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_logra import LoGRAFabricStrategy, LoGRAStepInputs, ProbeBatch
from lightning_logra.strategies.runtime import LOGRA_FOLDER
from tests.distributed import run_lightning_on_two_ranks
from tests.lightning_helpers import CausalLM, config, token_rows, trained_weights

STEPS = 4


class ProbedLM(CausalLM):
    """A Fabric module offering its last batch to the KL probe and a fixed log-prob gap."""

    def loss(self, batch):
        self.last_batch = batch
        return super().loss(batch)

    def logra_step_inputs(self):
        trainer_logprobs = torch.full((2, 3), -1.0)
        return LoGRAStepInputs(
            probe=ProbeBatch.from_token_batch(self.last_batch["input_ids"], self.last_batch["attention_mask"]),
            logprob_pairs=(trainer_logprobs + 0.01, trainer_logprobs, torch.ones(2, 3)),
        )


def fabric_run(devices, steps, save_to=None, load_from=None, start=0, logra=None):
    """Steps start..steps of one run; each rank takes its share of every global batch."""
    strategy = LoGRAFabricStrategy(logra=logra or config(kl_control=True, update_ratio=1e-2, kl_budget=1e-4))
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric.launch()
        module = ProbedLM()
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        state = {"model": model, "optimizer": optimizer, "step": start}
        if load_from is not None:
            fabric.load(load_from, state)
        rows = token_rows()
        for step in range(state["step"], steps):
            batch = rows[step * 4 : (step + 1) * 4].chunk(fabric.world_size)[fabric.global_rank]
            fabric.backward(module.loss({"input_ids": batch, "attention_mask": torch.ones_like(batch)}))
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step + 1
        if save_to is not None:
            fabric.save(save_to, state)
    logra = strategy.logra_optimizer
    return {
        "weights": trained_weights(strategy),
        "moments": full_moments(logra),
        "counters": (logra.update_count, logra.mismatch, logra.skipped_steps),
        "alpha": strategy.last_report.alpha if strategy.last_report else None,  # None: no step ran
    }


def full_moments(logra):
    """Every row of every RowAdam moment (a collective under FSDP2: every rank calls it)."""
    moments = logra.state_dict()["second_moments"].values()
    return [(m.full_tensor() if hasattr(m, "full_tensor") else m).clone() for m in moments]


def _save_then_resume(rank, world, folder):
    uninterrupted = fabric_run(world, STEPS)
    fabric_run(world, STEPS // 2, save_to=Path(folder) / "ckpt")
    resumed = fabric_run(world, STEPS, load_from=Path(folder) / "ckpt")
    return uninterrupted, resumed


def _load_on_two_then_save(rank, world, folder):
    return fabric_run(world, STEPS // 2, load_from=Path(folder) / "one", save_to=Path(folder) / "two")


def assert_identical(uninterrupted, resumed):
    assert resumed["counters"] == uninterrupted["counters"] and resumed["counters"][0] == STEPS
    assert uninterrupted["counters"][1] > 0  # the mismatch EMA is part of what resumes
    assert resumed["alpha"] == uninterrupted["alpha"]
    for a, b in zip(resumed["weights"] + resumed["moments"], uninterrupted["weights"] + uninterrupted["moments"]):
        assert torch.equal(a, b)


def test_fabric_save_and_load_resume_bit_identically(tmp_path):
    uninterrupted = fabric_run(1, STEPS)
    fabric_run(1, STEPS // 2, save_to=tmp_path / "ckpt")
    folder = tmp_path / "ckpt"
    assert (folder / LOGRA_FOLDER / ".metadata").is_file() and (folder / "meta.pt").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the .partial folder was renamed into place
    # LoGRA's state is DCP tensors only: no pickled metadata file to unpickle on load
    assert {".distcp" if p.suffix == ".distcp" else p.name for p in (folder / LOGRA_FOLDER).iterdir()} == {".metadata", ".distcp"}
    resumed = fabric_run(1, STEPS, load_from=folder)
    assert_identical(uninterrupted, resumed)


@pytest.mark.distributed
def test_two_process_fabric_save_and_load_resume_bit_identically(tmp_path):
    for uninterrupted, resumed in run_lightning_on_two_ranks(_save_then_resume, str(tmp_path)):
        assert_identical(uninterrupted, resumed)


@pytest.mark.distributed
def test_a_checkpoint_moves_between_one_and_two_processes(tmp_path):
    saved = fabric_run(1, STEPS // 2, save_to=tmp_path / "one")
    on_two = run_lightning_on_two_ranks(_load_on_two_then_save, str(tmp_path))
    back_on_one = fabric_run(1, STEPS // 2, load_from=tmp_path / "two")
    for loaded in [*on_two, back_on_one]:
        assert loaded["counters"] == saved["counters"] and loaded["counters"][0] == STEPS // 2
        for a, b in zip(loaded["weights"] + loaded["moments"], saved["weights"] + saved["moments"]):
            assert torch.equal(a, b)


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
