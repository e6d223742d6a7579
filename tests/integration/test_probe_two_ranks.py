"""The KL probe on two gloo processes holding different numbers of sequences: every rank runs
the same forwards and gets the global mean; on an FSDP2-sharded model neither a step nor a
generation leaves gathered weights behind."""

import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAOptimizer, LoGRAStepInputs, ProbeBatch, probe_predicted_kl
from tests.helpers.core import prepared_probe_model, probe_sequences
from tests.helpers.distributed import run_on_two_ranks
from tests.helpers.models import PROBE_VOCAB, probe_qwen2


def _probe_on_uneven_ranks(rank: int, world: int) -> tuple[float, int]:
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()
    rows = slice(0, 2) if rank == 0 else slice(2, 3)  # rank 0 has two sequences, rank 1 one
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    prediction = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids[rows], attention_mask[rows], logits_mask[rows]),
                                    process_group=torch.distributed.group.WORLD)
    return prediction, len(forwards)


@pytest.mark.distributed
def test_distributed_probe_runs_equal_forwards_and_returns_the_global_mean():
    model, optimizer = prepared_probe_model("sdpa")
    input_ids, attention_mask, logits_mask = probe_sequences()
    single = probe_predicted_kl(model, optimizer.probe_layers(), ProbeBatch(input_ids, attention_mask, logits_mask))
    (rank0, forwards0), (rank1, forwards1) = run_on_two_ranks(_probe_on_uneven_ranks)
    # Sharded models gather weights in every forward, so the rank with one sequence must
    # run a second (scoring nothing) to match the other.
    assert forwards0 == forwards1 == 2
    assert rank0 == rank1
    assert rank0 == pytest.approx(single, rel=1e-9)


def sharded(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_logra.strategies.sharding import shard_policy

    shard_policy(model, init_device_mesh("cpu", (world,)), LoGRAConfig().target_modules)
    return model, model.get_input_embeddings().weight  # the root's shard, as the user's optimizer holds it


def change_seen_by_the_next_forward(model, root_shard, input_ids, attention_mask) -> bool:
    """Whether a forward after the user's optimizer changed a root shard reads the change,
    as one after an explicit reshard does."""
    with torch.no_grad():
        root_shard.to_local().mul_(0.5)  # the user's optimizer stepping a non-target in the root
        next_forward = model(input_ids=input_ids, attention_mask=attention_mask).logits
        model.reshard()
        regathered = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return torch.equal(next_forward, regathered)


def _root_change_seen_after_a_step(rank: int, world: int) -> bool:
    model, embedding = sharded(probe_qwen2("sdpa"), world)
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=16, update_ratio=2e-3, update_factor_dtype="float32"))
    input_ids, attention_mask, logits_mask = probe_sequences()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, PROBE_VOCAB), input_ids[:, 1:].reshape(-1)).backward()
    optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch(input_ids, attention_mask, logits_mask)),
                   process_group=torch.distributed.group.WORLD, measure_kl=True)
    return change_seen_by_the_next_forward(model, embedding, input_ids, attention_mask)


def _root_change_seen_after_a_generation(rank: int, world: int) -> bool:
    import tempfile
    from pathlib import Path

    from lightning_logra.rollout.hf import HFRolloutEngine
    from tests.helpers.models import byte_tokenizer, tiny_qwen2

    model, embedding = sharded(tiny_qwen2(vocab_size=259), world)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = byte_tokenizer(Path(folder))
    rollouts = HFRolloutEngine(model, tokenizer, max_new_tokens=4).generate(["1+1=", "2+2="][rank:rank + 1])
    return change_seen_by_the_next_forward(model, embedding, rollouts.input_ids, rollouts.attention_mask)


@pytest.mark.distributed
def test_a_step_leaves_no_gathered_weights_that_a_later_forward_would_read_stale():
    # FSDP2 keeps a root module's gathered weights after a forward that no backward follows
    # (the probe's): they cost memory until the next backward, and a forward after the
    # optimizer changed the root's shards would read the old copy.
    assert run_on_two_ranks(_root_change_seen_after_a_step) == [True, True]


@pytest.mark.distributed
def test_a_generation_leaves_no_gathered_weights_that_a_later_forward_would_read_stale():
    assert run_on_two_ranks(_root_change_seen_after_a_generation) == [True, True]
