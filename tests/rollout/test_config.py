"""RolloutConfig lives in rollout/ (rollout/ imports nothing above it); checkpoints written
when it was lightning_logra.rl.config.RolloutConfig still load, under weights_only too."""

import io

import torch

from lightning_logra.rollout.config import RolloutConfig


def test_a_checkpoint_that_names_the_old_module_loads_under_weights_only(monkeypatch):
    buffer = io.BytesIO()
    with monkeypatch.context() as patch:
        patch.setattr(RolloutConfig, "__module__", "lightning_logra.rl.config")  # as checkpoints before the move
        torch.save({"rollout": RolloutConfig(num_generations=3)}, buffer)
    assert b"lightning_logra.rl.config" in buffer.getvalue()
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"rollout": RolloutConfig(num_generations=3)}


def test_a_new_checkpoint_names_rollout_config_and_loads_under_weights_only():
    buffer = io.BytesIO()
    torch.save({"rollout": RolloutConfig(engine="vllm")}, buffer)
    assert b"lightning_logra.rollout.config" in buffer.getvalue()
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"rollout": RolloutConfig(engine="vllm")}
