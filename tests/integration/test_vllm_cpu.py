"""The vLLM rollout engine, run for real on CPU (vllm-cpu): sampling log-probs, proven weight
sync, and GRPO steps with LoGRA and dense AdamW. CI runs these in their own virtual
environment (``.ci/run``); elsewhere they are skipped unless vLLM is installed."""

import importlib.util
import warnings

import lightning as L
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.data import PromptDataModule
from lightning_logra.modules import BatchingConfig, GRPOModule, OptimizerConfig, RolloutConfig
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import WorkerMirror, reward_config
from tests.helpers.models import byte_tokenizer, favour_token
from tests.helpers.tools import add

pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here (CI runs this file in its vllm-cpu environment)"),
]
PROMPTS = ["What is 2 + 3?", "Hi"]


def vllm_sized_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    """Tiny, but with 64-wide attention heads: vLLM's CPU attention kernels need head_dim >= 32;
    1,024 positions: a prompt listing tools is some 450 byte tokens."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-qwen2")
    tokenizer = byte_tokenizer(path)
    model = vllm_sized_qwen2(len(tokenizer))
    with torch.no_grad():
        favour_token(model, tokenizer.eos_token_id, 1.5)  # some completions stop early
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(folder):
    from lightning_logra.rollout import VLLMRolloutEngine
    from lightning_logra.rollout.base import RolloutEngine

    engine = VLLMRolloutEngine(folder, max_new_tokens=8, temperature=0.7, kv_cache_gib=0.25)
    assert isinstance(engine, RolloutEngine)  # the whole Protocol GRPOModule relies on
    return engine


def trainer_logprobs(model, rollouts, temperature):
    mask = rollouts.attention_mask
    with torch.no_grad():
        logits = model(input_ids=rollouts.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, rollouts.input_ids[:, 1:, None])[..., 0]
    completion = rollouts.completion_mask[:, 1:].bool()
    return logprobs[completion], rollouts.rollout_logprobs[:, 1:][completion]


def test_vllm_samples_with_the_models_logprobs_on_cpu(engine, folder):
    from transformers import AutoModelForCausalLM

    rollouts = engine.generate(PROMPTS, num_generations=3)
    assert rollouts.input_ids.shape[0] == 6 and rollouts.input_ids.device.type == "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer, sampled = trainer_logprobs(model, rollouts, 0.7)
    torch.testing.assert_close(sampled, trainer, rtol=0, atol=1e-4)


def test_weight_sync_is_proven_and_a_stale_engine_is_caught(engine, folder):
    from transformers import AutoModelForCausalLM

    from lightning_logra.rollout.vllm import StaleWeightsError

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    with pytest.raises(StaleWeightsError, match="differ from the trainer's"):
        engine.check_sync(model)  # the engine still holds the old weights
    engine.sync_weights(model)
    assert engine.last_sync_gap <= 1e-4
    trainer, sampled = trainer_logprobs(model, engine.generate(PROMPTS, num_generations=2), 0.7)
    torch.testing.assert_close(sampled, trainer, rtol=0, atol=1e-4)


def fit_with_vllm(folder, strategy, steps=2, devices=1, max_new_tokens=6, tools=None, callbacks=(), **rollout):
    grpo = GRPOModule(model=folder, rollout=RolloutConfig(engine="vllm", num_generations=2, max_new_tokens=max_new_tokens,
                                                          val_generations=2, kv_cache_gib=0.25, **rollout),
                      optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, decay_steps=0),
                      batching=BatchingConfig(micro_batch_size=2), reward=reward_config("varied_reward"), tools=tools)
    logged = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    data = PromptDataModule(train="arithmetic", val="arithmetic", tokenizer=folder, batch_size=2, train_size=16, val_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, callbacks=[Capture(), *([LoGRACallback()] if strategy != "auto" else []),
                                                  *callbacks]).fit(grpo, data)
    return grpo, logged


def test_grpo_with_logra_samples_from_every_update(folder):
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    grpo, logged = fit_with_vllm(folder, strategy)
    assert strategy.logra_optimizer.update_count == 2
    assert grpo.engine.last_sync_gap <= 1e-4  # checked after each update's sync; a stale one raises
    assert all(step["policy/rollout_trainer_logprob_gap_abs"] < 1e-3 for step in logged)
    assert all(step["policy/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3) for step in logged)  # on with vLLM


def test_grpo_with_dense_adamw_samples_from_every_update(folder):
    grpo, logged = fit_with_vllm(folder, "auto")
    assert grpo.engine.last_sync_gap <= 1e-4
    assert all(step["policy/rollout_trainer_logprob_gap_abs"] < 1e-3 for step in logged)


def test_vllm_continues_the_exact_tokens_of_a_tool_conversation(engine, folder):
    # Turn 1 sampled by vLLM, a tool turn's tokens appended as they are, turn 2 sampled from
    # exactly those tokens (TokensPrompt): the trainer scores the same tokens with the same
    # log-probs, and the tool tokens are context (mask 0, log-prob 0).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_logra.rollout import pack_rollouts
    from lightning_logra.tools import ToolCall, ToolChat, tool_schema

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine.sync_weights(model)  # the module's engine may hold another test's weights
    chat, schemas = ToolChat(tokenizer), [tool_schema(add)]
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 2 + 3?"}], schemas)
    first = engine.continue_tokens([prompt, prompt], [5, 3], temperature=1.0)
    assert [len(turn.token_ids) <= limit for turn, limit in zip(first, [5, 3])] == [True, True]
    tool = chat.tool_turn_ids([ToolCall("add", {"a": 2, "b": 3})], [{"role": "tool", "name": "add", "content": "5"}],
                              schemas)
    second = engine.continue_tokens([prompt + turn.token_ids + tool for turn in first], [4, 4], temperature=1.0)
    rollouts = pack_rollouts(
        prompt_ids=[prompt, prompt],
        completion_ids=[a.token_ids + tool + b.token_ids for a, b in zip(first, second)],
        completion_logprobs=[a.logprobs + [0.0] * len(tool) + b.logprobs for a, b in zip(first, second)],
        completion_text=["", ""], ended_with_eos=[b.ended_with_eos for b in second], pad_token_id=tokenizer.pad_token_id,
        environment_masks=[[0] * len(a.token_ids) + [1] * len(tool) + [0] * len(b.token_ids)
                           for a, b in zip(first, second)])
    assert rollouts.environment_mask.sum().item() == 2 * len(tool)
    trainer, sampled = trainer_logprobs(model, rollouts, 1.0)
    assert trainer.numel() == sum(len(a.token_ids) + len(b.token_ids) for a, b in zip(first, second))
    torch.testing.assert_close(sampled, trainer, rtol=0, atol=1e-4)


def test_grpo_with_tools_runs_conversations_through_vllm(folder):
    grpo, logged = fit_with_vllm(folder, "auto", steps=1, max_new_tokens=24, tools=["tests.helpers.tools:add"])
    assert {"turns/mean", "tools/calls_per_sample", "tools/failures"} <= set(logged[0])
    assert logged[0]["turns/mean"] >= 1.0
    assert logged[0]["policy/rollout_trainer_logprob_gap_abs"] < 1e-3


def test_low_rank_sync_sends_a_fraction_and_keeps_the_engine_exact(folder):
    # 20 LoGRA updates: a full sync when the engine starts and at every 10th sync, (alpha D,
    # seed) per target in between; the engine's copy must track the trainer's weights exactly.
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    grpo, logged = fit_with_vllm(folder, strategy, steps=20, weight_sync="lowrank", full_sync_every=10)
    assert strategy.logra_optimizer.update_count == 20 and strategy.logra_optimizer.skipped_steps == 0
    sent = [step["perf/weight_sync_bytes"] for step in logged]
    full = sum(t.numel() * t.element_size() for t in grpo.policy.state_dict().values())
    assert [b == full for b in sent] == [(step + 1) % 10 == 0 for step in range(20)]  # syncs 10 and 20 are full
    targets = sum(state.weight.shape[0] for state in strategy.logra_optimizer.sketches)
    assert all(b == targets * 8 * 4 + 8 * 14 for b, is_full in zip(sent, [b == full for b in sent]) if not is_full)
    assert grpo.engine.drift(grpo.policy) == 0.0  # the same float32 products, in the same order
    assert grpo.engine.last_sync_gap <= 1e-4


def test_low_rank_sync_refuses_updates_that_are_not_logra(folder):
    with pytest.raises(ValueError, match="needs every optimizer step to be a LoGRA update"):
        fit_with_vllm(folder, "auto", steps=1, weight_sync="lowrank")


def test_one_step_off_vllm_worker_follows_every_logra_update(folder):
    # vLLM in the rollout worker process: the trainer sends each update's (alpha D, seed) to
    # the worker, whose float32 copy follows bit for bit; vLLM reloads the copy and proves it
    # after every sync (a stale reload raises there and fails the run here).
    strategy, mirror = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3)), WorkerMirror()
    grpo, logged = fit_with_vllm(folder, strategy, steps=3, max_staleness=1, worker_threads=1, callbacks=[mirror])
    assert strategy.logra_optimizer.update_count == 3
    assert mirror.gaps == [0.0, 0.0, 0.0] and mirror.staleness == [0.0, 1.0, 1.0]
    targets = sum(state.weight.shape[0] for state in strategy.logra_optimizer.sketches)
    assert mirror.sync_bytes == [float(targets * 8 * 4 + 8 * 14)] * 3


def _two_rank_logra_with_vllm(rank, world, folder, weight_sync):
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    grpo, logged = fit_with_vllm(folder, strategy, devices=2, steps=3, weight_sync=weight_sync)
    weights = [state.weight.full_tensor() for state in strategy.logra_optimizer.sketches]
    gaps = [step["policy/rollout_trainer_logprob_gap_abs"] for step in logged]
    drift = grpo.engine.drift(grpo.policy) if weight_sync == "lowrank" else 0.0
    return strategy.logra_optimizer.update_count, grpo.engine.last_sync_gap, gaps, weights, drift


@pytest.mark.distributed
@pytest.mark.parametrize("weight_sync", ["full", "lowrank"])
def test_two_processes_sync_fsdp2_shards_into_their_engines(folder, weight_sync):
    # Each rank runs its own vLLM (external_launcher). In full, the FSDP2-sharded policy is
    # gathered one tensor at a time into both; low-rank, each update's row-sharded alpha D is
    # gathered instead. Each engine's sync check passes after every update.
    (count0, gap0, gaps0, weights0, drift0), (count1, gap1, gaps1, weights1, drift1) = run_lightning_on_two_ranks(
        _two_rank_logra_with_vllm, folder, weight_sync)
    # Each rank's copy is updated over all rows, the trainer over its own row shard: the GEMMs
    # differ in shape, so float32 round-off may differ (bounded per update; reset by full syncs).
    assert drift0 <= 1e-6 and drift1 <= 1e-6
    assert count0 == count1 == 3
    assert gap0 <= 1e-4 and gap1 <= 1e-4
    assert max(gaps0) < 1e-3 and gaps0 == gaps1  # the metric is reduced over ranks
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))


def test_a_generative_judge_answers_through_vllm_as_through_hf(tmp_path):
    # A judge whose head scores the byte "y" along the mean hidden state and every other token 0:
    # on these two questions its first greedy token is "y" (the HF engine's answers, checked on
    # this seed's model), on both engines, so both score each sample 1.
    from lightning_logra.rollout.judge import JudgeReward

    tokenizer = byte_tokenizer(tmp_path)
    model = vllm_sized_qwen2(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight.zero_()
        favour_token(model, tokenizer.convert_tokens_to_ids("y"), strength=50.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    template = "Is {completion} the answer to {prompt}? Say y or n."
    judges = [JudgeReward(str(tmp_path), template, {"y": 1.0, "n": 0.0}, engine=engine, max_new_tokens=1,
                          kv_cache_gib=0.25) for engine in ("hf", "vllm")]
    scores = [judge(["5", "6"], prompts=["2 + 2?"] * 2) for judge in judges]
    assert scores == [[1.0, 1.0]] * 2
    assert judges[1].weight_bytes() == judges[0].weight_bytes()  # float32 on CPU, counted from the shapes
