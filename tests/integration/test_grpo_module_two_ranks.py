"""GRPOModule with logra_fsdp on two processes: both ranks update and end with the same
weights; a validation's samples from both ranks make one table."""

import warnings

import lightning as L
import pytest
import torch

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.modules import LoggingConfig
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import TableLogger, grpo_module, prompt_data


def _two_rank_fit(rank, world, folder):
    grpo = grpo_module(folder)
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, callbacks=[LoGRACallback()]).fit(grpo, prompt_data(folder))
    return strategy.logra_optimizer.update_count, [s.weight.full_tensor() for s in strategy.logra_optimizer.sketches]


@pytest.mark.distributed
def test_two_process_logra_fit_updates_both_ranks_to_equal_weights(model_folder):
    (count0, weights0), (count1, weights1) = run_lightning_on_two_ranks(_two_rank_fit, model_folder)
    assert count0 == count1 == 2
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))


def _two_rank_validation(rank, world, folder):
    logger = TableLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = L.Trainer(accelerator="cpu", devices=2, strategy=LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8)),
                            logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False).validate(grpo_module(folder, logging=LoggingConfig(val_completions=True)),
                                                                 prompt_data(folder), verbose=False)[0]
    return logger.tables, metrics["val/pass_at_1"]


@pytest.mark.distributed
@pytest.mark.slow  # 15 s; the two-process fit above keeps GRPOModule on two ranks in the default run
def test_one_validation_table_holds_both_ranks_samples(model_folder):
    (tables0, pass0), (tables1, pass1) = run_lightning_on_two_ranks(_two_rank_validation, model_folder)
    assert tables1 == [] and len(tables0) == 1  # rank 0 logs the gathered table
    key, columns, data, step = tables0[0]
    assert key == "val_completions" and step == 0
    prompt, reward = columns.index("prompt"), columns.index("reward")
    assert len(data) == 4 * 2 and len({row[prompt] for row in data}) == 4  # 2 prompts per rank x 2 samples
    assert pass0 == pass1 == pytest.approx(sum(row[reward] > 0 for row in data) / len(data), abs=1e-6)


def _two_rank_kl_from_init(rank, world, folder):
    grpo = grpo_module(folder, logging=LoggingConfig(kl_from_init=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8)),
                            max_steps=1, val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(grpo, prompt_data(folder))  # one step, then a validation
    return float(trainer.callback_metrics["val/kl_from_init"])


@pytest.mark.distributed
def test_kl_from_init_on_two_ranks_with_a_sharded_initial_copy(model_folder):
    # The policy and its frozen initial weights are both FSDP2-sharded; every rank runs as
    # many forwards as the other, and the metric is the mean over both ranks' samples.
    kl0, kl1 = run_lightning_on_two_ranks(_two_rank_kl_from_init, model_folder)
    assert kl0 == kl1 > 0
