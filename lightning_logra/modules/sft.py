"""SFTModule: supervised fine-tuning of a causal LM on chat data, one batch of
conversations an optimizer step, e.g. to warm a model up on a tool format before RL.

    batch (input_ids, attention_mask, loss_mask: ConversationDataModule)
    -> per micro-batch: token log-probs, loss = NLL summed over trained tokens / the batch's
       trained tokens -> manual_backward
    -> optimizer step (under logra_fsdp: a LoGRA update whose KL probe scores the batch's
       own assistant tokens) -> lr schedule

Like ``GRPOModule`` it knows nothing of LoGRA beyond handing the step its inputs: dense
AdamW, LoRA adapters (``lora``) or LoGRA come from the strategy. The policy is
``self.policy`` and its hyper-parameters are ``model`` and ``lora``, so ``logra export``
writes an SFT checkpoint as a Hugging Face folder that RL starts from
(``--model.init_args.model=<folder>``).
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_logra.core.probe import ProbeBatch
from lightning_logra.core.step_inputs import LoGRAStepInputs
from lightning_logra.core.validation import FieldChecks
from lightning_logra.hooks import ReportsLoGRASteps
from lightning_logra.models import build_model, load_tokenizer, model_source, with_lora
from lightning_logra.rl.config import LoRAConfig, OptimizerConfig
from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE, sequence_logprobs
from lightning_logra.rl.step import optimizer_with_schedule


class SFTModule(L.LightningModule):
    """Supervised fine-tuning on the assistant turns of ``ConversationDataModule`` batches.

    The loss is the mean negative log-likelihood of the batch's trained tokens (``loss_mask``:
    the assistant turns, their end-of-turn tokens included; prompts and tool results are
    context), each rank over its own batch; ``micro_batch_size`` rows at a time go through
    forward and backward, weighted so that the gradient is that of the whole batch.

    Under ``logra_fsdp`` each step is a LoGRA update whose KL probe scores the batch's own
    trained positions, so ``logra.kl_budget`` bounds how far one step moves the model's
    predictions of the assistant tokens it trains on. ``optimizer`` (AdamW and its
    schedule) steps dense and LoRA runs, as in ``GRPOModule``.

    Args:
        model: hub id, local folder, or the offline built-in ``"smollm2-135m-instruct"``.
        optimizer: AdamW and its warm-up/cosine schedule (dense and LoRA runs).
        lora: train LoRA adapters of this shape instead of the full weights.
        micro_batch_size: rows per forward/backward (None: the whole batch at once).
        activation_checkpointing: recompute each decoder layer's activations in backward.
        logprob_chunk_positions: positions whose vocabulary-sized logits exist at once.
        cache_dir: where the built-in model is converted once.
    """

    def __init__(
        self,
        model: str,
        optimizer: OptimizerConfig | None = None,
        lora: LoRAConfig | None = None,
        micro_batch_size: int | None = None,
        activation_checkpointing: bool = False,
        logprob_chunk_positions: int = DEFAULT_CHUNK_SIZE,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        check = FieldChecks("SFTModule", {"micro_batch_size": micro_batch_size,
                                          "logprob_chunk_positions": logprob_chunk_positions,
                                          "activation_checkpointing": activation_checkpointing})
        check.integer("micro_batch_size", at_least=1, optional=True)
        check.integer("logprob_chunk_positions", at_least=1)
        check.boolean("activation_checkpointing")
        self.save_hyperparameters()
        self.optimizer_config = optimizer or OptimizerConfig()
        self.micro_batch_size = micro_batch_size
        self.logprob_chunk_positions = logprob_chunk_positions
        self._activation_checkpointing = activation_checkpointing
        self._model_source = model_source(model, cache_dir)
        self.tokenizer = load_tokenizer(self._model_source)
        self.automatic_optimization = False
        self.policy: torch.nn.Module | None = None
        if lora is not None:  # built in full now, as GRPOModule does: peft draws the adapters here
            self.policy = with_lora(self._load(empty=False), lora)
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        """Build the policy once (under ``logra_fsdp``, in a meta-device context: empty, then
        filled rank by rank from the safetensors files after sharding)."""
        if self.policy is None:
            self.policy = self._load(empty=torch.get_default_device().type == "meta")

    def _load(self, *, empty: bool) -> torch.nn.Module:
        return build_model(self._model_source, self.tokenizer, empty=empty,
                           activation_checkpointing=self._activation_checkpointing)

    def logra_model(self) -> torch.nn.Module:
        return self.policy

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        started = time.perf_counter()
        optimizer = self.optimizers()
        optimizer.zero_grad()
        trained = batch["loss_mask"][:, 1:]  # log-prob t scores token t + 1
        tokens = int(trained.sum())
        if tokens == 0:
            raise ValueError("an SFT batch has no trained token: every row needs an assistant turn "
                             "(ConversationDataModule refuses rows without one)")
        loss = torch.zeros((), device=self.device)
        rows = batch["input_ids"].shape[0]
        step = self.micro_batch_size or rows
        for start in range(0, rows, step):
            part = slice(start, start + step)
            logprobs = sequence_logprobs(self.policy, batch["input_ids"][part], batch["attention_mask"][part],
                                         chunk_size=self.logprob_chunk_positions)
            part_loss = -(logprobs * trained[part]).sum() / tokens
            self.manual_backward(part_loss)
            loss += part_loss.detach()
        if isinstance(self.trainer.strategy, ReportsLoGRASteps):
            optimizer.step(logra_inputs=LoGRAStepInputs(probe=self._probe(batch)))
        else:
            optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=rows)
        self.log("train/trained_tokens", float(tokens), on_step=True, batch_size=rows)
        self.log("perf/step_seconds", time.perf_counter() - started, on_step=True, batch_size=rows)

    @staticmethod
    def _probe(batch: dict[str, torch.Tensor]) -> ProbeBatch:
        """The batch's own trained positions: ``logits_mask[:, t]`` marks the distribution
        that predicts token t + 1, a trained one."""
        logits_mask = torch.zeros_like(batch["loss_mask"])
        logits_mask[:, :-1] = batch["loss_mask"][:, 1:]
        return ProbeBatch(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_mask=logits_mask)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """``val/loss``: the mean NLL per trained token over the whole validation set."""
        trained = batch["loss_mask"][:, 1:]
        logprobs = sequence_logprobs(self.policy, batch["input_ids"], batch["attention_mask"],
                                     chunk_size=self.logprob_chunk_positions)
        tokens = trained.sum()
        self.val_loss.update(-(logprobs * trained).sum() / tokens.clamp(min=1), weight=tokens)
        self.log("val/loss", self.val_loss, on_epoch=True, prog_bar=True, batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self):
        """AdamW and its warm-up + cosine schedule over the trainable parameters, as
        ``GRPOModule``'s: stepped by dense and LoRA runs, the handle of LoGRA's steps under
        ``logra_fsdp``."""
        return optimizer_with_schedule(self.policy.parameters(), self.optimizer_config)
