"""`logra export` of a logra_fsdp checkpoint written by two processes (FSDP2 shards): the
exported model computes the trained policy's logits bit for bit."""

from pathlib import Path

import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.models import export_checkpoint, load_policy
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import exported_logits, fit_to_checkpoint, grpo_for_export, initial_logits, policy_logits


def _fit_on_two_ranks(rank, world, folder, root):
    module = grpo_for_export(folder)
    fit_to_checkpoint(module, folder, Path(root), LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-2)), devices=2)
    return {name: value.full_tensor() for name, value in module.policy.state_dict().items()}


@pytest.mark.distributed
def test_two_process_fsdp2_checkpoint_exports_the_trained_policy_bit_for_bit(tied_folder, tmp_path):
    weights, _ = run_lightning_on_two_ranks(_fit_on_two_ranks, tied_folder, str(tmp_path / "run"))
    trained_policy = load_policy(tied_folder)[0]
    trained_policy.load_state_dict(weights)
    trained = policy_logits(trained_policy)
    assert not torch.equal(trained, initial_logits(tied_folder))
    exported = export_checkpoint(tmp_path / "run" / "ckpt" / "final.ckpt", tmp_path / "hf")
    assert torch.equal(exported_logits(exported.path), trained)
