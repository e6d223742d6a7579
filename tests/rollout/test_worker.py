"""rollout/worker.py: the rollout engine in a process of its own samples what the engine in
this process samples, follows the trainer's weights bit for bit, and fails loudly."""

import pytest
import torch

from lightning_logra.core.lowrank import LowRankUpdate
from lightning_logra.models import load_policy, load_tokenizer
from lightning_logra.rollout.config import RolloutConfig
from lightning_logra.rollout.hf import HFRolloutEngine
from lightning_logra.rollout.worker import RolloutWorker, RolloutWorkerError

pytestmark = pytest.mark.integration  # each test starts a worker process

CONFIG = RolloutConfig(num_generations=2, max_new_tokens=6)
PROMPTS = ["1 + 2 =", "7 - 3 ="]


@pytest.fixture
def worker(model_folder):
    worker = RolloutWorker(model_folder, load_tokenizer(model_folder), CONFIG, threads=torch.get_num_threads())
    yield worker
    worker.close()


def local_engine(model_folder):
    policy, _ = load_policy(model_folder)
    return policy, HFRolloutEngine(policy, load_tokenizer(model_folder), max_new_tokens=CONFIG.max_new_tokens)


def test_the_worker_samples_what_this_process_samples_from_the_same_weights_and_seed(worker, model_folder):
    policy, engine = local_engine(model_folder)
    worker.load(dict(policy.named_parameters()), version=0)
    worker.submit("batch", PROMPTS, num_generations=2, seed=5)
    torch.manual_seed(5)
    here = engine.generate(PROMPTS, num_generations=2)
    there, version = worker.receive("batch")
    assert version == 0
    assert torch.equal(there.input_ids, here.input_ids)
    assert torch.equal(there.rollout_logprobs, here.rollout_logprobs)
    assert there.completion_text == here.completion_text


def test_the_worker_follows_low_rank_updates_and_trained_weights_bit_for_bit(worker, model_folder):
    policy, _ = load_policy(model_folder)
    weights = dict(policy.named_parameters())
    weights["model.layers.0.self_attn.q_proj.weight"].data.normal_()  # no longer the folder's weights
    worker.load(weights, version=3)
    target = "model.layers.1.mlp.up_proj.weight"
    rows, width = weights[target].shape
    update = LowRankUpdate(name=target, factor=torch.randn(rows, 4), seed=11, width=width, distribution="rademacher",
                           projection_dtype=torch.float32, chunk_rows=3)
    norm = "model.norm.weight"
    with torch.no_grad():
        update.apply_to(weights[target])
        weights[norm].add_(0.25)
    worker.update([update], {norm: weights[norm]}, version=4)
    assert worker.last_sync_bytes == rows * 4 * 4 + 8 + weights[norm].numel() * 4
    received = worker.weights()
    assert received.keys() == weights.keys()
    assert all(torch.equal(received[name], tensor) for name, tensor in weights.items())


def test_dropped_requests_are_thrown_away_and_later_ones_still_arrive(worker, model_folder):
    policy, _ = load_policy(model_folder)
    worker.load(dict(policy.named_parameters()), version=0)
    worker.submit(0, PROMPTS, num_generations=2, seed=0)
    worker.submit(1, PROMPTS[:1], num_generations=2, seed=1)
    worker.drop(0)
    rollouts, _ = worker.receive(1)
    assert rollouts.input_ids.shape[0] == 2
    worker.submit(2, PROMPTS, num_generations=1, seed=2)
    assert worker.receive(2)[0].input_ids.shape[0] == 2


def test_a_weight_the_worker_lacks_fails_with_its_name(worker):
    worker.load({"model.no_such.weight": torch.zeros(2)}, version=0)
    with pytest.raises(RolloutWorkerError, match=r"model\.no_such\.weight"):
        worker.weights()
    assert not worker.alive


def test_a_worker_that_cannot_start_says_why(tmp_path, model_folder):
    with pytest.raises(RolloutWorkerError, match="rollout worker failed"):
        RolloutWorker(str(tmp_path / "missing"), load_tokenizer(model_folder), CONFIG, threads=1)
