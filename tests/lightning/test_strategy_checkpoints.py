"""Resuming a logra_fsdp Trainer run, and inputs that must fail before any weight changes."""

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from tests.helpers.lightning import CausalLM, config, loader, trained_weights, trainer

STEPS_PER_EPOCH = 2  # 32 rows, 16 per batch: checkpoints fall on epoch boundaries


def run(tmp_path, max_steps, logra=None, ckpt_path=None, save_every=None):
    strategy = LoGRAFSDPStrategy(logra=logra or config())
    callbacks = [LoGRACallback()]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=save_every, save_top_k=-1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=max_steps, tmp_path=tmp_path, callbacks=callbacks,
                enable_checkpointing=bool(save_every)).fit(CausalLM(), loader(16), ckpt_path=ckpt_path)
    return strategy


def test_resume_from_a_checkpoint_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    uninterrupted = run(tmp_path / "a", max_steps=4)
    first = run(tmp_path / "b", max_steps=STEPS_PER_EPOCH, save_every=STEPS_PER_EPOCH)
    checkpoints = sorted((tmp_path / "b" / "ckpt").iterdir())
    assert len(checkpoints) == 1 and checkpoints[0].is_dir()  # a distributed checkpoint folder
    resumed = run(tmp_path / "c", max_steps=4, ckpt_path=checkpoints[0])
    assert first.logra_optimizer.update_count == STEPS_PER_EPOCH
    assert resumed.logra_optimizer.update_count == uninterrupted.logra_optimizer.update_count == 4
    for a, b in zip(trained_weights(resumed), trained_weights(uninterrupted)):
        assert torch.equal(a, b)
    for a, b in zip(resumed.logra_optimizer.sketches, uninterrupted.logra_optimizer.sketches):
        assert torch.equal(a.second_moment, b.second_moment)
        assert torch.equal(a.projection, b.projection)
    assert resumed.logra_optimizer.mismatch == uninterrupted.logra_optimizer.mismatch


def test_resuming_with_another_logra_config_fails_before_any_update(tmp_path):
    run(tmp_path / "b", max_steps=STEPS_PER_EPOCH, save_every=STEPS_PER_EPOCH)
    checkpoint = next((tmp_path / "b" / "ckpt").iterdir())
    with pytest.raises(ValueError, match="rank: 8 != 16"):
        run(tmp_path / "c", max_steps=4, logra=config(rank=16), ckpt_path=checkpoint)


def fit_expecting(error, match, module=None, logra=None, **trainer_options):
    strategy = LoGRAFSDPStrategy(logra=logra or config())
    module = module or CausalLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with warnings.catch_warnings(), pytest.raises(error, match=match):
        warnings.simplefilter("ignore")
        trainer(strategy, max_steps=1, **trainer_options).fit(module, loader(4))
    for key, value in module.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(value, before[key]), key


def test_unknown_target_names_are_an_error():
    fit_expecting(ValueError, "no module of .* matches target_modules=\\['qproj'\\]", logra=config(target_modules=["qproj"]))


def test_non_linear_target_is_an_error():
    fit_expecting(TypeError, "'model.norm' is a Qwen2RMSNorm", logra=config(target_modules=["q_proj", "norm"]))


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_float16_precision_is_refused(precision):
    # Lightning itself refuses 16-mixed for FSDP2 strategies; LoGRA refuses 16-true.
    fit_expecting(ValueError, f"precision='{precision}'", precision=precision)


def test_manual_step_without_backward_is_an_error():
    class StepsWithoutBackward(CausalLM):
        def training_step(self, batch, batch_idx):
            self.optimizers().step()

    module = StepsWithoutBackward(manual_micro_batches=1)
    fit_expecting(RuntimeError, "no backward pass", module=module)


def test_default_config_is_the_papers():
    assert LoGRAFSDPStrategy().logra_config == LoGRAConfig()
