"""GRPOModule under logra_fsdp on two processes: the policy and the KL reference are built
empty (meta device) in configure_model, FSDP2-sharded, then each rank fills its own rows
from the safetensors files; the result equals a full ``from_pretrained`` bit for bit."""

import warnings

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.models import is_empty
from lightning_logra.modules import LossConfig
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import LOGIT_TOKENS, grpo_module, prompt_data


class Recorded(Exception):
    """Ends the fit once the loaded weights are recorded (no step needs to run)."""


class StopAtFitStart(L.Callback):
    """Records the loaded weights and logits before any step changes them, then ends the fit."""

    def on_fit_start(self, trainer, grpo):
        self.tied = grpo.policy.lm_head.weight is grpo.policy.get_input_embeddings().weight
        self.local_rows = grpo.policy.model.embed_tokens.weight.to_local().shape[0]
        with torch.no_grad():
            self.policy = {name: value.full_tensor() for name, value in grpo.policy.state_dict().items()}
            self.reference = {name: value.full_tensor() for name, value in grpo.reference.state_dict().items()}
            self.logits = grpo.policy.eval()(input_ids=LOGIT_TOKENS).logits
        raise Recorded


def _two_rank_load(rank, world, folder, precision):
    grpo = grpo_module(folder, loss=LossConfig(kl_coef=0.1))
    built_empty = []
    configure_model = grpo.configure_model

    def recording_configure_model():
        configure_model()
        built_empty.append((is_empty(grpo.policy), is_empty(grpo.reference)))

    grpo.configure_model = recording_configure_model
    stop = StopAtFitStart()
    with warnings.catch_warnings(), pytest.raises(Recorded):
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=2, strategy=LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8)), max_steps=1,
                  logger=False, precision=precision, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, callbacks=[stop]).fit(grpo, prompt_data(folder))
    return built_empty, stop.policy, stop.reference, stop.logits, stop.tied, stop.local_rows


@pytest.mark.distributed
# bf16 is a second case of the same two-process load (10 s): slow; float32 stays in the default run.
@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_two_processes_fill_their_rows_of_policy_and_reference_as_from_pretrained(tied_folder, precision):
    full = AutoModelForCausalLM.from_pretrained(tied_folder, dtype=torch.float32).eval()
    reference_dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    full_reference = AutoModelForCausalLM.from_pretrained(tied_folder, dtype=reference_dtype)
    with torch.no_grad():
        logits = full(input_ids=LOGIT_TOKENS).logits
    vocab = full.config.vocab_size
    ranks = run_lightning_on_two_ranks(_two_rank_load, tied_folder, precision)
    assert [rank[-1] for rank in ranks] == [(vocab + 1) // 2, vocab // 2]  # each rank's embedding: its rows only
    for built_empty, policy, reference, rank_logits, tied, _ in ranks:
        assert built_empty == [(True, True)]  # no rank held a whole model before sharding
        assert tied  # the head is still the embedding
        assert policy.keys() == full.state_dict().keys() == reference.keys()
        for name, value in full.state_dict().items():
            assert value.dtype == policy[name].dtype and torch.equal(policy[name], value), name
        for name, value in full_reference.state_dict().items():
            assert value.dtype == reference[name].dtype and torch.equal(reference[name], value), name
        assert torch.equal(rank_logits, logits)  # rotary frequencies computed as from_pretrained computes them
