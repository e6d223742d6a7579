"""A plain causal-LM LightningModule nobody wrote for LoGRA, its data, and the plain-torch
reference run that the strategies must reproduce."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_logra import LoGRAConfig, LoGRAOptimizer
from tests.tiny_models import tiny_qwen2

VOCAB = 64
SEQUENCE = 10


def config(**overrides) -> LoGRAConfig:
    """Unscaled steps (alpha = 1) unless overridden, to compare with the plain engine."""
    return LoGRAConfig(**{"rank": 8, "update_ratio": 1e-3, "update_factor_dtype": "float32", "kl_control": False, **overrides})


def token_rows(count: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def dataset(count: int = 32) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in token_rows(count)]


class CausalLM(L.LightningModule):
    """Fine-tunes an HF causal LM on its own tokens with a mean cross-entropy loss."""

    def __init__(self, lr: float = 1e-3, manual_micro_batches: int = 0) -> None:
        super().__init__()
        self.model = tiny_qwen2(VOCAB)
        self.lr = lr
        self.manual_micro_batches = manual_micro_batches
        self.automatic_optimization = manual_micro_batches == 0

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"]).loss

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            loss = self.loss(batch)
            self.log("train_loss", loss, batch_size=batch["input_ids"].shape[0])
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        for part in zip(*(batch[key].chunk(self.manual_micro_batches) for key in ("input_ids", "attention_mask"))):
            micro = dict(zip(("input_ids", "attention_mask"), part))
            self.manual_backward(self.loss(micro) / self.manual_micro_batches)
        optimizer.step()
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def loader(batch_size: int, count: int = 32, rank: int = 0, world: int = 1) -> DataLoader:
    """In order; with ``world`` > 1, rank r takes rows r, r + world, ... (as the trainers are
    built with use_distributed_sampler=False, which would otherwise shuffle)."""
    rows = dataset(count)
    return DataLoader(rows, batch_size=batch_size, sampler=DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=False))


def reference_weights(steps: int, global_batch: int, logra: LoGRAConfig, micro_batches: int = 1) -> list[torch.Tensor]:
    """The plain-torch engine on one process over the same global batches (mean loss)."""
    model = tiny_qwen2(VOCAB)
    model.train()
    optimizer = LoGRAOptimizer(model, logra)
    rows = token_rows()
    for step in range(steps):
        optimizer.zero_grad()
        batch = rows[step * global_batch : (step + 1) * global_batch]
        for part in batch.chunk(micro_batches):
            (model(input_ids=part, labels=part).loss / micro_batches).backward()
        optimizer.prepare_update(normalization_tokens=1)
        optimizer.apply_update(alpha=1.0)
    return [state.weight.detach().clone() for state in optimizer.sketches]


def trained_weights(strategy) -> list[torch.Tensor]:
    """Full target weights after training (a collective under FSDP2: every rank calls it)."""
    return [
        (state.weight.full_tensor() if hasattr(state.weight, "full_tensor") else state.weight.detach()).clone()
        for state in strategy.logra_optimizer.sketches
    ]


def trainer(strategy, max_steps: int, tmp_path=None, devices: int = 1, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, use_distributed_sampler=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


class TinyCausalLM(CausalLM):
    """CausalLM with its own data, for CLI configs."""

    def __init__(self, lr: float = 1e-3, batch_size: int = 4) -> None:
        super().__init__(lr=lr)
        self.batch_size = batch_size
        self.save_hyperparameters()

    def train_dataloader(self):
        return loader(self.batch_size)


def record_step_inputs(module) -> list:
    """Keep every ``LoGRAStepInputs`` the strategy asks ``module`` for, one per optimizer step."""
    recorded, step_inputs = [], module.logra_step_inputs

    def recording():
        recorded.append(step_inputs())
        return recorded[-1]

    module.logra_step_inputs = recording
    return recorded
