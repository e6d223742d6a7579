"""GRPOModule on a tiny random Qwen2: reward functions named by import path, the module and
its prompt data, a fit that records every batch's metrics, the KL reference-model and export
runs, a module that records what a resume test compares, a logger that keeps the
tables it is given, and a callback that compares a rollout worker's weights with the trainer's."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from transformers import AutoModelForCausalLM

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.core.projection import canonical_name
from lightning_logra.data import PromptDataModule
from lightning_logra.models import load_policy
from lightning_logra.modules.async_rollouts import trained_weights
from lightning_logra.modules import BatchingConfig, GRPOModule, LossConfig, OptimizerConfig, RewardConfig, RolloutConfig
from lightning_logra.rl.logprobs import sequence_logprobs
from tests.helpers.lightning import record_step_inputs

# -- Reward functions: a module names them as "tests.helpers.grpo:<name>" --

SEEN: dict[str, list] = {}  # the arguments recording_reward was last called with


def rewards(name: str) -> list[str]:
    """The ``reward.functions`` list of one of this module's reward functions."""
    return [f"tests.helpers.grpo:{name}"]


def reward_config(name: str, **options) -> RewardConfig:
    """A ``RewardConfig`` of one of this module's reward functions, with ``options``."""
    return RewardConfig(functions=rewards(name), **options)


def varied_reward(completions, **kwargs):
    """A reward a random tiny model earns unevenly, so that advantages are not all zero."""
    return [sum(map(ord, str(c))) % 7 / 7 for c in completions]


def odd_answer_reward(completions, answer, **kwargs):
    """Varies only for prompts with an odd answer: the groups of even answers carry no signal."""
    return [sum(map(ord, str(c))) % 7 / 7 if int(a) % 2 else 0.0 for c, a in zip(completions, answer)]


class _RecordingReward:
    """A reward with state: a callable object, so that RewardRunner runs it in a thread of
    this process (a plain function runs in a worker process, where SEEN would not be ours)."""

    __name__ = "recording_reward"

    def __call__(self, completions, **kwargs):
        SEEN.update(completions=completions, **kwargs)
        return [0.5] * len(completions)


recording_reward = _RecordingReward()


def answer_reward(completions, answer, **kwargs):
    """Scores only rows with a reference answer (None for the others)."""
    return [None if a is None else 1.0 for a in answer]


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


# -- The module, its data, a fit --


def grpo_module(folder, **overrides) -> GRPOModule:
    """2 samples of at most 6 tokens per prompt, micro-batches of 2, a constant lr of 1e-3,
    varied_reward; dense AdamW unless the strategy is logra_fsdp."""
    options = dict(
        model=folder,
        rollout=RolloutConfig(num_generations=2, max_new_tokens=6, val_generations=2),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, decay_steps=0),
        batching=BatchingConfig(micro_batch_size=2),
        reward=reward_config("varied_reward"),
    )
    options.update(overrides)
    return GRPOModule(**options)


def prompt_data(folder, batch_size=2) -> PromptDataModule:
    """16 arithmetic prompts to train on, 4 to validate on."""
    return PromptDataModule(train="arithmetic", val="arithmetic", tokenizer=folder, batch_size=batch_size,
                            train_size=16, val_size=4)


def fit_grpo(grpo, folder, steps=2, strategy="auto", loggers=False, data_options=None, callbacks=(), devices=1,
             caught_warnings=None):
    """Fit; returns the trainer and the metrics logged at every training batch. The fit's
    warnings are ignored, or appended to ``caught_warnings`` when it is a list."""
    logged = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    options = dict(train="arithmetic", val="arithmetic", tokenizer=folder, batch_size=2, train_size=16, val_size=4)
    data = PromptDataModule(**{**options, **(data_options or {})})
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=loggers,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Capture(), *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore" if caught_warnings is None else "always")
        trainer.fit(grpo, data)
    if caught_warnings is not None:
        caught_warnings.extend(caught)
    return trainer, logged


# -- One-step-off rollouts: the worker beside the trainer --


class WorkerMirror(L.Callback):
    """After every training step (its sync sent): the largest |worker - trainer| weight and what the step logged."""

    def __init__(self) -> None:
        self.gaps, self.staleness, self.sync_bytes = [], [], []

    def on_train_batch_end(self, trainer, module, *args):
        theirs = module._async.worker.weights()
        ours = {canonical_name(n): t for n, t in trained_weights(module.policy, trainable_only=False).items()}
        self.gaps.append(max(float((theirs[name] - tensor).abs().max()) for name, tensor in ours.items()))
        self.staleness.append(float(trainer.callback_metrics["rollout/staleness"]))
        self.sync_bytes.append(float(trainer.callback_metrics["perf/weight_sync_bytes"]))


# -- A KL reference model --

BF16_ATOL = 0.02  # bf16 rounds at 2^-8 relative; log-probs here are ~5.6 in size; measured max 1.4e-3


def fit_with_reference(folder, precision, devices=1):
    """One logra_fsdp step of a module with a KL reference model (kl_coef 0.1) under ``precision``;
    the module keeps every step's inputs in ``grpo.probes``."""
    grpo = grpo_module(folder, loss=LossConfig(kl_coef=0.1))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    grpo.probes = record_step_inputs(strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, precision=precision,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0).fit(grpo, prompt_data(folder))
    return grpo


def reference_and_plain_logprobs(grpo, folder):
    """The trained module's reference vs a fresh unsharded float32 copy, on the last rollouts."""
    batch = grpo.probes[-1].probe
    plain, _ = load_policy(folder)
    with torch.no_grad():
        kept = sequence_logprobs(grpo.reference, batch.input_ids, batch.attention_mask)
        fresh = sequence_logprobs(plain.eval(), batch.input_ids, batch.attention_mask)
    mask = batch.logits_mask[:, :-1]
    return kept[mask], fresh[mask]


# -- Export: a checkpoint, and the logits of the policy it holds --

LOGIT_TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def grpo_for_export(folder: str, **overrides) -> GRPOModule:
    """Like grpo_module, shorter: at most 4 new tokens, no validation, no activation checkpointing."""
    options = dict(
        model=folder, reward=reward_config("varied_reward"), batching=BatchingConfig(micro_batch_size=2),
        rollout=RolloutConfig(num_generations=2, max_new_tokens=4),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, decay_steps=0), activation_checkpointing=False,
    )
    return GRPOModule(**{**options, **overrides})


def fit_to_checkpoint(module: GRPOModule, folder: str, root: Path, strategy, devices: int = 1, steps: int = 1) -> Path:
    """Train ``steps`` steps and return the checkpoint ModelCheckpoint writes at the end."""
    data = PromptDataModule(train="arithmetic", tokenizer=folder, batch_size=2, train_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                  callbacks=[ModelCheckpoint(dirpath=root / "ckpt", filename="final")]).fit(module, data)
    return root / "ckpt" / "final.ckpt"


@torch.no_grad()
def policy_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits ``model`` computes on LOGIT_TOKENS, in eval mode."""
    return model.eval()(input_ids=LOGIT_TOKENS).logits


def exported_logits(folder: Path) -> torch.Tensor:
    return policy_logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))


def initial_logits(folder: str) -> torch.Tensor:
    return policy_logits(load_policy(folder)[0])


# -- Resume: a module that records every logged metric and its final weights --


class RecordingGRPO(GRPOModule):
    """Keeps every step's logged training metrics (``history``) and, at the end, the full
    policy weights (``final_weights``; rank 0 also saves both to ``record_to``)."""

    def __init__(self, *args, record_to: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record_to = record_to
        self.history: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if not k.startswith(("perf/", "memory/"))}
        self.history[self.global_step] = metrics

    def on_train_end(self) -> None:
        weights = {}
        for name, value in self.policy.state_dict().items():
            weights[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
        if self.record_to and self.global_rank == 0:
            torch.save({"weights": weights, "history": self.history, "baseline": self.baseline.value}, self.record_to)
        self.final_weights = weights


class SlowDown(Callback):
    """Gives a kill -9 test time to strike mid-step."""

    def __init__(self, seconds: float = 0.5) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)


class TableLogger(Logger):
    """A logger with a ``log_table`` method, like Weights & Biases'."""

    def __init__(self):
        super().__init__()
        self.tables = []

    name, version = "tables", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_table(self, key, columns, data, step=None):
        self.tables.append((key, columns, data, step))
