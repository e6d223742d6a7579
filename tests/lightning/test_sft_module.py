"""SFTModule: the loss is the mean NLL of the assistant tokens (tool results and prompts are
context), micro-batches give the whole batch's gradient, and under logra_fsdp the KL probe
scores exactly the trained positions."""

import warnings

import lightning as L
import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.data import ConversationDataModule
from lightning_logra.modules import OptimizerConfig, SFTModule
from tests.helpers.lightning import record_step_inputs

TOOLS = ["lightning_logra.tools:calculator"]


def conversations(folder, batch_size=4) -> ConversationDataModule:
    return ConversationDataModule("calculator:1", "calculator:1", tokenizer=folder, tools=TOOLS, batch_size=batch_size,
                                  train_size=8, val_size=4)


def fit(module, data, strategy="auto", steps=1, callbacks=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=list(callbacks))
        trainer.fit(module, data)
    return trainer


class GradientsAndBatches(L.Callback):
    """The policy's gradients just before each optimizer step, and each training batch."""

    def __init__(self):
        self.gradients, self.batches = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append({key: value.clone() for key, value in batch.items()})

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.gradients.append({name: p.grad.clone() for name, p in module.policy.named_parameters() if p.grad is not None})


def direct_loss(model, batch) -> torch.Tensor:
    """The mean NLL of the trained tokens, from the model's full logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    trained = batch["loss_mask"][:, 1:]
    return -(logprobs * trained).sum() / trained.sum()


def test_the_gradient_is_that_of_the_mean_nll_of_assistant_tokens_whole_or_in_micro_batches(model_folder):
    gradients = {}
    for micro_batch_size in (None, 1):
        torch.manual_seed(0)
        module = SFTModule(model_folder, micro_batch_size=micro_batch_size, optimizer=OptimizerConfig(lr=1e-3))
        recorder = GradientsAndBatches()
        fit(module, conversations(model_folder), callbacks=[recorder])
        gradients[micro_batch_size] = recorder.gradients[0]
    batch = recorder.batches[0]
    fresh = SFTModule(model_folder)
    fresh.configure_model()
    direct_loss(fresh.policy, batch).backward()
    for name, parameter in fresh.policy.named_parameters():
        # float32 sums in another order (chunked log-probs, one row at a time): 1e-5 relative.
        torch.testing.assert_close(gradients[None][name], parameter.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gradients[1][name], parameter.grad, rtol=1e-5, atol=1e-7)


def test_under_logra_the_probe_scores_the_trained_positions_and_the_loss_falls(model_folder):
    torch.manual_seed(0)
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-2, kl_budget=1e-2, kl_budget_final=1e-2))
    recorded = record_step_inputs(strategy)
    module = SFTModule(model_folder)
    recorder = GradientsAndBatches()
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    fit(module, conversations(model_folder, batch_size=8), strategy=strategy, steps=6, callbacks=[recorder, Losses()])
    assert len(recorded) == 6
    for inputs, batch in zip(recorded, recorder.batches):
        probe = inputs.probe
        assert torch.equal(probe.input_ids, batch["input_ids"])
        assert torch.equal(probe.logits_mask[:, :-1], batch["loss_mask"][:, 1:]) and not probe.logits_mask[:, -1].any()
        assert inputs.logprob_pairs is None and inputs.normalization_tokens == 1.0
    assert strategy.last_report is not None
    # The same 8 conversations every step (one batch per epoch): each LoGRA step lowers their loss.
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_micro_batch_size_is_checked():
    with pytest.raises(ValueError, match=r"SFTModule.micro_batch_size = 0 is invalid"):
        SFTModule("unused", micro_batch_size=0)


def test_with_lora_only_the_adapters_train_and_export_merges_them(model_folder, tmp_path):
    from lightning_logra.models import export_checkpoint
    from lightning_logra.modules import LoRAConfig

    torch.manual_seed(0)
    module = SFTModule(model_folder, lora=LoRAConfig(rank=4, alpha=8.0), optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0))
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    trainer = fit(module, conversations(model_folder), steps=2)
    changed = {name for name, p in module.policy.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)
    trainer.save_checkpoint(tmp_path / "sft.ckpt")
    exported = export_checkpoint(tmp_path / "sft.ckpt", tmp_path / "model")
    assert exported.lora_merged
