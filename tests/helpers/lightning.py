"""A plain causal-LM LightningModule nobody wrote for LoGRA, its data, Trainer and Fabric
runs of it (one with NaN losses injected, one that saves and loads), and the plain-torch
reference run that the strategies must reproduce."""

from __future__ import annotations

import sys
import warnings
from unittest import mock

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_logra import (
    LoGRACallback,
    LoGRAConfig,
    LoGRAFabricStrategy,
    LoGRAFSDPStrategy,
    LoGRAOptimizer,
    LoGRAStepInputs,
    ProbeBatch,
)
from tests.helpers.models import tiny_qwen2

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


def record_step_inputs(strategy) -> list:
    """Keep every ``LoGRAStepInputs`` handed down to ``strategy``'s LoGRA steps, one per
    optimizer step (nothing under a strategy that is not logra_fsdp)."""
    recorded = []
    runtime = getattr(strategy, "runtime", None)
    if runtime is None:
        return recorded
    step = runtime.step

    def recording(user_optimizer, inputs, **kwargs):
        recorded.append(inputs)
        return step(user_optimizer, inputs, **kwargs)

    runtime.step = recording
    return recorded


# -- Faults: a loss that turns NaN on chosen steps --


class PoisonedLoss(CausalLM):
    """Returns a NaN loss on the chosen steps (on one rank only, if ``rank`` is set)."""

    def __init__(self, poisoned_steps, rank=None):
        super().__init__()
        self.poisoned_steps = set(poisoned_steps)
        self.poisoned_rank = rank
        self.weights_after_step = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step in self.poisoned_steps and self.poisoned_rank in (None, self.global_rank):
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weights_after_step.append(trained_weights(self.trainer.strategy))


def fit_recording_warnings(module, logra, steps, devices=1, rank=0, world=1):
    """Fit ``module`` with logra_fsdp and LoGRACallback on 4-row global batches (rank r of
    ``world`` takes its share); returns the strategy and the message of every warning raised."""
    strategy = LoGRAFSDPStrategy(logra=logra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, max_steps=steps, devices=devices, callbacks=[LoGRACallback(log_memory=False)]).fit(
            module, loader(4 // world, rank=rank, world=world))
    return strategy, [str(w.message) for w in caught]


# -- Fabric --


def fabric_loop(fabric, rank, world) -> list[torch.Tensor]:
    """Three steps of a CausalLM set up by ``fabric`` on 4-row global batches (rank r of
    ``world`` takes its share); the trained target weights."""
    module = CausalLM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        rows = torch.stack([row["input_ids"] for row in dataset()])
        for step in range(3):
            batch = rows[step * 4 : (step + 1) * 4].chunk(world)[rank]
            fabric.backward(module.loss({"input_ids": batch, "attention_mask": torch.ones_like(batch)}))
            optimizer.step()  # no inputs: kl_control is off
            optimizer.zero_grad()
    return trained_weights(fabric.strategy)


FABRIC_STEPS = 4  # fabric_run's whole run; the resume tests save after half of it


class ProbedLM(CausalLM):
    """A Fabric module offering its last batch to the KL probe and a fixed log-prob gap."""

    def loss(self, batch):
        self.last_batch = batch
        return super().loss(batch)

    def step_inputs(self) -> LoGRAStepInputs:
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
            strategy.logra_step(optimizer, module.step_inputs())
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


def assert_identical(uninterrupted, resumed):
    """Two ``fabric_run`` results of FABRIC_STEPS steps are one run: counters, alpha, weights
    and moments, bit for bit."""
    assert resumed["counters"] == uninterrupted["counters"] and resumed["counters"][0] == FABRIC_STEPS
    assert uninterrupted["counters"][1] > 0  # the mismatch EMA is part of what resumes
    assert resumed["alpha"] == uninterrupted["alpha"]
    for a, b in zip(resumed["weights"] + resumed["moments"], uninterrupted["weights"] + uninterrupted["moments"]):
        assert torch.equal(a, b)


def in_process_cli(config_file, *overrides):
    """``LoGRACLI`` built in this process (``run=False``) from ``config_file``, seeded, with
    pytest's own argv hidden (LightningCLI warns when it sits beside ``args``)."""
    from lightning_logra.cli import LoGRACLI

    with mock.patch.object(sys, "argv", ["logra"]):
        return LoGRACLI(subclass_mode_model=True, args=["-c", str(config_file), "--seed_everything=0", *overrides],
                        run=False)
