"""``GRPOModule``'s validation: pass@1 and pass@n over n samples of each validation prompt,
the KL of the policy from its initial weights on those samples (``logging.kl_from_init``),
tool calls per conversation, and a table of the samples (``logging.val_completions``). A
mixin: the attributes it reads are ``GRPOModule``'s."""

from __future__ import annotations

import torch

from lightning_logra.modules.completions import completion_table, log_completion_table
from lightning_logra.rl.collectives import gather_objects
from lightning_logra.rl.sampling import ScoredRollouts, sampling_seed, score_rollouts
from lightning_logra.rl.step_kl import completion_kl
from lightning_logra.rollout.base import Rollouts


class PassAtNValidation:
    """``GRPOModule``'s validation hooks."""

    _val_tables: list[dict[str, list]]

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        config = self.rollout_config
        n = config.val_generations
        torch.manual_seed(sampling_seed(self.seed + 1, batch_idx, self.global_rank))
        rollouts = self._rollouts(batch, n, temperature=config.val_temperature, top_p=config.val_top_p)
        scores, columns = score_rollouts(self.reward_runner, rollouts, batch, n)
        self._warn_if_unscored(scores, columns)
        totals = torch.tensor(scores.total, device=self.device)
        if self.logging.val_completions:
            scored = ScoredRollouts(rollouts, columns, scores, totals)
            self._val_tables.append(completion_table(scored, step=self.global_step, count=totals.numel()))
        if self.logging.kl_from_init:
            self._log_kl_from_init(rollouts, batch_idx)
        if self.val_tool_calls is not None:
            calls = torch.tensor([float(c.tool_calls) for c in rollouts.conversations], device=self.device)
            self.val_tool_calls.update(calls)
            self.log("val/tools/calls_per_sample", self.val_tool_calls, on_epoch=True, batch_size=calls.numel())
        correct = (totals > 0).float().view(-1, n)
        self.val_pass_at_1.update(correct.mean(dim=1))
        self.val_pass_at_n.update(correct.amax(dim=1))  # unbiased pass@k with k = n
        self.log("val/pass_at_1", self.val_pass_at_1, on_epoch=True, prog_bar=True, batch_size=correct.shape[0])
        self.log(f"val/pass_at_{n}", self.val_pass_at_n, on_epoch=True, batch_size=correct.shape[0])

    def _log_kl_from_init(self, rollouts: Rollouts, batch_idx: int) -> None:
        """``val/kl_from_init`` over these validation samples' completion positions."""
        seed = sampling_seed(self.seed + 2, batch_idx, self.global_rank)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        kl_sum, positions = completion_kl(self.policy, self.reference, rollouts, self._micro_batching, generator)
        self.val_kl_from_init.update(kl_sum / positions.clamp(min=1), weight=positions)
        self.log("val/kl_from_init", self.val_kl_from_init, on_epoch=True, batch_size=rollouts.input_ids.shape[0])

    def on_validation_epoch_start(self) -> None:
        self._val_tables = []  # nothing left over from an interrupted validation

    def on_validation_epoch_end(self) -> None:
        if not self.logging.val_completions:
            return
        tables = gather_objects(self._val_tables)
        if self.global_rank == 0 and tables:
            table = {column: [value for part in tables for value in part[column]] for column in tables[0]}
            log_completion_table(self.loggers, table, step=self.global_step, name="val_completions")
