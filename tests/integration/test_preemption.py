"""Preemption as a user meets it (issue 42, section 5): `logra fit` sent SIGTERM during step 2
checkpoints the end of that step, prints its summary and exits with 143; `--ckpt_path=hpc`
then ends with the weights, baseline and metrics of an uninterrupted run. Two ranks stop
after the same step when only one of them is signalled."""

import warnings
from pathlib import Path

import pytest
import torch

from lightning_logra import LoGRAFSDPStrategy
from lightning_logra.callbacks import Preempted, PreemptionCheckpoint
from tests.helpers.distributed import start_logra_fit, run_lightning_on_two_ranks
from tests.helpers.lightning import CausalLM, config, loader, trained_weights, trainer
from tests.helpers.preemption import SignalDuringStep
from tests.integration.test_resume import REWARD


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  enable_progress_bar: false
  enable_checkpointing: false
  logger: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra: {{rank: 8, update_ratio: 1.0e-3, kl_budget: 1.0e-3}}
  callbacks:
    - class_path: lightning_logra.LoGRACallback
      init_args: {{log_memory: false}}
    - class_path: lightning_logra.callbacks.RunSummary
{signal}
model:
  class_path: tests.helpers.grpo.RecordingGRPO
  init_args:
    model: {model}
    reward: {{functions: [{reward}]}}
    batching: {{micro_batch_size: 2}}
    record_to: {root}/final.pt
    rollout: {{num_generations: 2, max_new_tokens: 5}}
    optimizer: {{lr: 1.0e-3, warmup_steps: 2, decay_steps: 6}}
data:
  class_path: lightning_logra.data.PromptDataModule
  init_args: {{train: arithmetic, tokenizer: {model}, batch_size: 2, train_size: 12}}
"""
SIGTERM_DURING_STEP_2 = "    - {class_path: tests.helpers.preemption.SignalDuringStep, init_args: {step: 2}}"


def logra_fit(root, model, *extra, signalled=False):
    """`logra fit` (which adds a PreemptionCheckpoint) of 4 GRPO steps, run in ``root``."""
    root.mkdir(exist_ok=True)
    config = root / "config.yaml"
    config.write_text(CONFIG.format(root=root, model=model, reward=REWARD,
                                    signal=SIGTERM_DURING_STEP_2 if signalled else ""))
    return start_logra_fit(config, root, *extra)


@pytest.mark.slow
def test_logra_fit_preempted_during_step_2_exits_143_then_resumes_to_the_uninterrupted_run(model_folder, tmp_path):
    reference = logra_fit(tmp_path / "uninterrupted", model_folder)
    preempted = logra_fit(tmp_path / "preempted", model_folder, signalled=True)
    output = preempted.communicate(timeout=300)[0]
    assert preempted.returncode == 143, output[-3000:]
    checkpoint = tmp_path / "preempted" / "hpc_ckpt_1.ckpt"
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"] == 2
    assert "Run summary: 2 steps" in output and "reward/mean" in output, output[-3000:]
    assert f"stopped by SIGTERM after step 2: checkpoint {checkpoint}" in output
    assert not (tmp_path / "preempted" / "final.pt").exists()

    resumed = logra_fit(tmp_path / "preempted", model_folder, "--ckpt_path=hpc", signalled=True)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert reference.wait(timeout=300) == 0, reference.stdout.read()[-3000:]
    a = torch.load(tmp_path / "preempted" / "final.pt", weights_only=False)
    b = torch.load(tmp_path / "uninterrupted" / "final.pt", weights_only=False)
    assert a["weights"].keys() == b["weights"].keys()
    for name, value in a["weights"].items():
        assert torch.equal(value, b["weights"][name]), name
    assert a["baseline"] == b["baseline"]
    for step in (3, 4):  # the steps the resumed run trained
        assert a["history"][step] == b["history"][step], step


def _fit_on_two_ranks(rank, world, root, max_steps, callbacks=(), ckpt_path=None):
    """4 steps of 8 rows a rank: 2 per epoch, so that step 2 ends an epoch."""
    strategy = LoGRAFSDPStrategy(logra=config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=max_steps, tmp_path=root, devices=2, callbacks=list(callbacks)
                ).fit(CausalLM(), loader(8, rank=rank, world=world), ckpt_path=ckpt_path)
    return trained_weights(strategy)


def _preempt_rank_1_then_resume(rank, world, root):
    root = Path(root)
    uninterrupted = _fit_on_two_ranks(rank, world, root / "a", max_steps=4)
    try:
        _fit_on_two_ranks(rank, world, root / "b", max_steps=4,
                          callbacks=[SignalDuringStep(2, ranks=[1]), PreemptionCheckpoint()])
        stopped = None
    except Preempted as preempted:
        stopped = (preempted.step, str(preempted.checkpoint))
    resumed = _fit_on_two_ranks(rank, world, root / "b", max_steps=4, ckpt_path="hpc")
    return stopped, all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))


@pytest.mark.distributed
def test_when_only_rank_1_is_signalled_both_ranks_stop_after_the_same_step_and_resume_exactly(tmp_path):
    """Lightning 2.6's own SIGTERM handler deadlocks here: rank 1 waits in its in-handler
    broadcast while rank 0 waits for rank 1 in FSDP's all-gather."""
    checkpoint = str(tmp_path / "b" / "hpc_ckpt_1.ckpt")
    assert run_lightning_on_two_ranks(_preempt_rank_1_then_resume, str(tmp_path)) == [((2, checkpoint), True)] * 2
