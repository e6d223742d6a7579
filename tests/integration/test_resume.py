"""Exact resume of a GRPO + LoGRA run (weights, LoGRA state, baseline, data position,
sampling) in 1 and 2 processes, and survival of a kill -9 mid-step."""

import os
import signal
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.data import PromptDataModule
from lightning_logra.modules import BatchingConfig, LossConfig, OptimizerConfig, RewardConfig, RolloutConfig
from tests.helpers.distributed import start_logra_fit, run_lightning_on_two_ranks
from tests.helpers.grpo import RecordingGRPO

REWARD = "tests.helpers.grpo:varied_reward"


def grpo(folder):
    return RecordingGRPO(
        model=folder, reward=RewardConfig(functions=[REWARD]), batching=BatchingConfig(micro_batch_size=2),
        loss=LossConfig(type="reinforce_baseline"),
        rollout=RolloutConfig(num_generations=2, max_new_tokens=5),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=2, decay_steps=6),
    )


def fit(folder, root, max_steps, devices=1, ckpt_path=None, save=False):
    module = grpo(folder)
    callbacks = [LoGRACallback(log_memory=False)]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3, kl_budget=1e-3))
    data = PromptDataModule(train="arithmetic", tokenizer=folder, batch_size=2, train_size=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                  callbacks=callbacks, enable_checkpointing=save).fit(module, data, ckpt_path=ckpt_path)
    return module, strategy


def assert_same_run(resumed, resumed_strategy, reference, reference_strategy, from_step):
    assert resumed.final_weights.keys() == reference.final_weights.keys()
    for name, value in resumed.final_weights.items():
        assert torch.equal(value, reference.final_weights[name]), name
    a, b = resumed_strategy.logra_optimizer, reference_strategy.logra_optimizer
    assert a.update_count == b.update_count and a.mismatch == b.mismatch
    assert all(torch.equal(x.second_moment, y.second_moment) for x, y in zip(a.sketches, b.sketches))
    assert resumed.baseline.value == reference.baseline.value
    for step in range(from_step + 1, b.update_count + 1):
        assert resumed.history[step] == reference.history[step], step


def test_resume_mid_epoch_equals_an_uninterrupted_run(model_folder, tmp_path):
    reference, reference_strategy = fit(model_folder, tmp_path / "a", max_steps=5)
    fit(model_folder, tmp_path / "b", max_steps=2, save=True)  # 6 batches per epoch: stops mid-epoch
    checkpoint = tmp_path / "b" / "ckpt" / "epoch=0-step=2.ckpt"
    resumed, resumed_strategy = fit(model_folder, tmp_path / "c", max_steps=5, ckpt_path=checkpoint)
    assert_same_run(resumed, resumed_strategy, reference, reference_strategy, from_step=2)


def _two_rank_resume(rank, world, folder, root):
    root = Path(root) / f"rank{rank}"
    reference, reference_strategy = fit(folder, root / "a", max_steps=4, devices=2)
    fit(folder, Path(str(root).replace(f"rank{rank}", "shared")) / "b", max_steps=2, devices=2, save=True)
    checkpoint = Path(str(root).replace(f"rank{rank}", "shared")) / "b" / "ckpt" / "epoch=0-step=2.ckpt"
    resumed, resumed_strategy = fit(folder, root / "c", max_steps=4, devices=2, ckpt_path=checkpoint)
    assert_same_run(resumed, resumed_strategy, reference, reference_strategy, from_step=2)
    return resumed_strategy.logra_optimizer.update_count


@pytest.mark.distributed
def test_two_process_resume_equals_an_uninterrupted_run(model_folder, tmp_path):
    assert run_lightning_on_two_ranks(_two_rank_resume, model_folder, str(tmp_path)) == [4, 4]


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  enable_progress_bar: false
  logger: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra: {{rank: 8, update_ratio: 1.0e-3, kl_budget: 1.0e-3}}
  callbacks:
    - class_path: lightning_logra.LoGRACallback
      init_args: {{log_memory: false}}
    - class_path: tests.helpers.grpo.SlowDown
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/ckpt, every_n_train_steps: 1, save_top_k: -1, save_last: true}}
model:
  class_path: tests.helpers.grpo.RecordingGRPO
  init_args:
    model: {model}
    reward: {{functions: [{reward}]}}
    batching: {{micro_batch_size: 2}}
    record_to: {root}/final.pt
    rollout: {{num_generations: 2, max_new_tokens: 5}}
    optimizer: {{lr: 1.0e-3, warmup_steps: 0, decay_steps: 0}}
data:
  class_path: lightning_logra.data.PromptDataModule
  init_args: {{train: arithmetic, tokenizer: {model}, batch_size: 2, train_size: 12}}
"""


def logra_fit(root, model, *extra):
    config = root / "config.yaml"
    config.write_text(CONFIG.format(root=root, model=model, reward=REWARD))
    return start_logra_fit(config, root, *extra)


def test_kill_9_mid_step_then_resume_loses_nothing(model_folder, tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    reference = logra_fit(uninterrupted, model_folder)

    killed = tmp_path / "killed"
    killed.mkdir()
    victim = logra_fit(killed, model_folder)
    deadline = time.monotonic() + 240
    while not (killed / "ckpt" / "epoch=0-step=3.ckpt").exists():
        assert victim.poll() is None, victim.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no step-3 checkpoint within 240 s"
        time.sleep(0.05)
    time.sleep(0.3)  # into step 4 (SlowDown makes each step last >= 0.5 s)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (killed / "final.pt").exists()

    resumed = logra_fit(killed, model_folder, "--ckpt_path=last")
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert reference.wait(timeout=300) == 0, reference.stdout.read()[-3000:]
    assert not list((killed / "ckpt").glob("*.partial"))

    a = torch.load(killed / "final.pt", weights_only=False)
    b = torch.load(uninterrupted / "final.pt", weights_only=False)
    for name, value in a["weights"].items():
        assert torch.equal(value, b["weights"][name]), name
    assert a["baseline"] == b["baseline"]
