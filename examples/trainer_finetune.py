"""Fine-tune an ordinary causal-LM LightningModule with LoGRA: only the Trainer line changes.

    python examples/trainer_finetune.py            # 1 CPU process
    python examples/trainer_finetune.py --devices 2

A tiny random Qwen2 learns to continue a fixed cyclic token pattern; the loss goes down.
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

import lightning_logra


class CausalLMFineTune(L.LightningModule):
    """Nothing LoGRA-specific: a model, a loss, an optimizer."""

    def __init__(self, vocab_size: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        self.model = Qwen2ForCausalLM(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def cyclic_rows(count: int, length: int = 24, vocab_size: int = 32) -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": (start + torch.arange(length) * 3) % vocab_size} for start in starts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    L.seed_everything(0)
    logra = lightning_logra.LoGRAConfig(rank=16, update_ratio=2e-2, kl_budget=2e-2, kl_budget_final=5e-3, schedule_steps=args.steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=lightning_logra.LoGRAFSDPStrategy(logra=logra),
        callbacks=[lightning_logra.LoGRACallback()],
        max_steps=args.steps,
        log_every_n_steps=5,
        logger=L.pytorch.loggers.CSVLogger("lightning_logs", name="trainer_finetune"),
        enable_checkpointing=False,
    )
    module = CausalLMFineTune()
    trainer.fit(module, DataLoader(cyclic_rows(640), batch_size=16))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f} (log(32) = 3.466 at random)")


if __name__ == "__main__":
    main()
