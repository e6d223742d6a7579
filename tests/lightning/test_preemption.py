"""Preemption (issue 42, section 5): a SIGTERM, or SLURM's requeue signal, during a step
saves a checkpoint at the end of that step, prints the run summary and exits with 143; a
resume from it equals an uninterrupted run. (A `logra fit` process of a GRPO run, and two
ranks: tests/integration/test_preemption.py.)"""

import logging
import os
import re
import stat
import warnings

import pytest
import torch

from lightning_logra import LoGRACallback, LoGRAFSDPStrategy
from lightning_logra.callbacks import Preempted, PreemptionCheckpoint, RunSummary
from tests.helpers.lightning import CausalLM, config, loader, trained_weights, trainer
from tests.helpers.preemption import SignalDuringStep
from tests.lightning.test_cli_callbacks import callbacks_of

SUMMARY_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where Lightning's rank_zero_info writes


class ValidatedCausalLM(CausalLM):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), batch_size=batch["input_ids"].shape[0])


def run(root, max_steps, callbacks=(), ckpt_path=None, validate=False, accumulate=1):
    """4 steps of 16 rows (``accumulate`` batches of 16 / ``accumulate`` each): 2 per epoch,
    so that step 2 ends an epoch (a plain DataLoader resumes exactly only there);
    ``validate``: a validation run after every 2 batches."""
    strategy = LoGRAFSDPStrategy(logra=config())
    module = ValidatedCausalLM() if validate else CausalLM()
    options = dict(val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=1) if validate else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=max_steps, tmp_path=root, callbacks=[LoGRACallback(), *callbacks],
                accumulate_grad_batches=accumulate, **options
                ).fit(module, loader(16 // accumulate), val_dataloaders=loader(8, count=16) if validate else None,
                      ckpt_path=ckpt_path)
    return strategy


def assert_same_training(resumed, uninterrupted):
    assert resumed.logra_optimizer.update_count == uninterrupted.logra_optimizer.update_count == 4
    for a, b in zip(trained_weights(resumed), trained_weights(uninterrupted)):
        assert torch.equal(a, b)
    for a, b in zip(resumed.logra_optimizer.sketches, uninterrupted.logra_optimizer.sketches):
        assert torch.equal(a.second_moment, b.second_moment) and torch.equal(a.projection, b.projection)
    assert resumed.logra_optimizer.mismatch == uninterrupted.logra_optimizer.mismatch


def checkpoint_step(checkpoint):
    return torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"]


def test_sigterm_during_a_step_checkpoints_its_end_and_the_resume_equals_an_uninterrupted_run(tmp_path, caplog):
    uninterrupted = run(tmp_path / "a", max_steps=4)
    root = tmp_path / "b"
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER), pytest.raises(Preempted) as stopped:
        run(root, max_steps=4, callbacks=[RunSummary(), SignalDuringStep(2), PreemptionCheckpoint()])
    checkpoint = root / "hpc_ckpt_1.ckpt"
    assert stopped.value.code == 143 and stopped.value.step == 2 and stopped.value.checkpoint == checkpoint
    assert checkpoint_step(checkpoint) == 2
    assert "Run summary: 2 steps" in caplog.text
    assert f"stopped by SIGTERM after step 2: checkpoint {checkpoint} (resume with --ckpt_path=hpc" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        resumed = run(root, max_steps=4, ckpt_path="hpc", callbacks=[RunSummary()])
    assert_same_training(resumed, uninterrupted)
    assert re.search(r"Run summary: 2 steps in \d+ s \(resumed at step 2, now at 4\)", caplog.text), caplog.text


def test_sigterm_during_validation_checkpoints_its_end(tmp_path):
    """Lightning alone would stop at the next validation batch, without a checkpoint."""
    uninterrupted = run(tmp_path / "a", max_steps=4, validate=True)
    root = tmp_path / "b"
    with pytest.raises(Preempted) as stopped:
        run(root, max_steps=4, validate=True,
            callbacks=[SignalDuringStep(2, in_validation=True), PreemptionCheckpoint()])
    assert stopped.value.step == 2 and checkpoint_step(stopped.value.checkpoint) == 2
    assert_same_training(run(root, max_steps=4, validate=True, ckpt_path="hpc"), uninterrupted)


def test_with_accumulated_gradients_the_checkpoint_waits_for_the_batch_that_steps(tmp_path):
    uninterrupted = run(tmp_path / "a", max_steps=4, accumulate=2)
    root = tmp_path / "b"
    with pytest.raises(Preempted) as stopped:  # sent during the first of step 2's two batches
        run(root, max_steps=4, accumulate=2, callbacks=[SignalDuringStep(2), PreemptionCheckpoint()])
    assert stopped.value.step == 2 and checkpoint_step(stopped.value.checkpoint) == 2
    assert_same_training(run(root, max_steps=4, accumulate=2, ckpt_path="hpc"), uninterrupted)


def test_a_signal_during_the_last_step_checkpoints_it_too(tmp_path):
    """Lightning stops before its end-of-training hooks even then."""
    with pytest.raises(Preempted):
        run(tmp_path, max_steps=2, callbacks=[SignalDuringStep(2), PreemptionCheckpoint()])
    assert checkpoint_step(tmp_path / "hpc_ckpt_1.ckpt") == 2


def test_without_the_callback_the_summary_says_that_sigterm_left_no_checkpoint(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER), pytest.raises(SystemExit) as stopped:
        run(tmp_path, max_steps=4, callbacks=[RunSummary(), SignalDuringStep(1)])
    assert not isinstance(stopped.value, Preempted)  # Lightning's own SIGTERMException
    assert "Run summary: 1 steps" in caplog.text and "stopped by SIGTERM at step 1, without a checkpoint" in caplog.text
    assert not list(tmp_path.glob("hpc_ckpt_*"))


def test_slurms_requeue_signal_checkpoints_the_end_of_the_step_then_requeues(tmp_path, monkeypatch):
    """Lightning's own handler would save inside the signal handler, mid-step, and train on."""
    requeued = tmp_path / "scontrol.log"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {requeued}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in dict(SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_JOB_ID="4242", SLURM_PROCID="0",
                            SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "run"
    with pytest.raises(Preempted) as stopped:
        run(root, max_steps=4, callbacks=[SignalDuringStep(2, "SIGUSR1"), PreemptionCheckpoint()])
    assert stopped.value.signal_name == "SIGUSR1" and stopped.value.step == 2
    assert [p.name for p in root.glob("hpc_ckpt_*")] == ["hpc_ckpt_1.ckpt"]
    assert checkpoint_step(root / "hpc_ckpt_1.ckpt") == 2
    assert requeued.read_text() == "requeue 4242\n"


def test_logra_fit_adds_a_preemption_checkpoint_unless_one_is_listed(tmp_path):
    assert callbacks_of(tmp_path).count(PreemptionCheckpoint) == 1
    listed = "[{class_path: lightning_logra.callbacks.PreemptionCheckpoint}]"
    assert callbacks_of(tmp_path, listed=listed).count(PreemptionCheckpoint) == 1
