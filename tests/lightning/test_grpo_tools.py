"""GRPOModule with tools: a step on a tiny model whose turns are scripted, under LoGRA and
dense AdamW; tool tokens are context everywhere (loss, KL probe, log-prob gap, lengths)."""

import warnings

import lightning as L
import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.modules import MultiTurnConfig, RolloutConfig
from lightning_logra.modules.completions import completion_table
from lightning_logra.rewards import RewardScores
from lightning_logra.rl.sampling import ScoredRollouts
from lightning_logra.rollout.base import Conversation, pack_rollouts
from tests.helpers.grpo import fit_grpo, grpo_module, prompt_data
from tests.helpers.lightning import record_step_inputs
from tests.helpers.tools import ScriptedGeneration

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
# Rows [p0 g0, p0 g1, p1 g0, p1 g1]: a call, an answer, a call to a missing tool, a call; then the three answer.
TURN_1 = [CALL, "7", CALL.replace('"add"', '"subtract"'), CALL]
TURN_2 = ["5", "no", "5"]


def tool_step(folder, strategy, turns=(TURN_1, TURN_2), **tool_sources):
    """One step with ``turns`` scripted and ``tool_sources`` (``tools=``/``environment_factory=``;
    default the ``add`` tool); returns the rollouts it trained on, the logged metrics and the
    LoGRA step inputs (under logra_fsdp)."""
    grpo = grpo_module(folder, multi_turn=MultiTurnConfig(max_turns=2),
                       rollout=RolloutConfig(num_generations=2, max_new_tokens=600, val_generations=2),
                       **(tool_sources or {"tools": ["tests.helpers.tools:add"]}))
    grpo.configure_model()
    ScriptedGeneration(grpo.policy, grpo.tokenizer, list(turns))
    sampled, generate = [], grpo.multi_turn.generate
    grpo.multi_turn.generate = lambda *args, **kwargs: sampled.append(generate(*args, **kwargs)) or sampled[-1]
    step_inputs = record_step_inputs(strategy)
    logged = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  callbacks=[Capture()]).fit(grpo, prompt_data(folder))
    return sampled[0], logged, step_inputs


def check_metrics(rollouts, logged):
    assert logged["turns/mean"] == 1.75
    assert logged["tools/calls_per_sample"] == 0.75
    assert logged["tools/failures"] == 1.0
    generated = rollouts.completion_mask.sum(dim=1).float()
    assert logged["completion/length_mean"] == pytest.approx(generated.mean().item())
    assert logged["completion/length_max"] == generated.max().item()


def test_logra_step_with_tools_probes_and_pairs_generated_tokens_only(model_folder):
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    rollouts, logged, step_inputs = tool_step(model_folder, strategy)
    check_metrics(rollouts, logged)
    [inputs] = step_inputs
    generated = rollouts.completion_mask[:, 1:].bool()
    tools = rollouts.environment_mask.bool()
    assert tools.sum() > 0 and not (rollouts.completion_mask.bool() & tools).any()
    order = torch.tensor([0, 2, 1, 3])  # the probe takes one sample of each prompt first
    assert torch.equal(inputs.probe.input_ids, rollouts.input_ids[order])
    assert torch.equal(inputs.probe.logits_mask[:, :-1], generated[order])
    assert not inputs.probe.logits_mask[:, :-1][tools[order][:, 1:]].any()
    assert torch.equal(inputs.logprob_pairs.mask, generated)  # every row ended on EOS


def test_dense_step_with_tools_trains_on_generated_tokens_only(model_folder, monkeypatch):
    import lightning_logra.rl.step as step_code

    masks, backward = [], step_code.backward_micro_batches
    monkeypatch.setattr(step_code, "backward_micro_batches",
                        lambda policy, batch, *args, **kwargs: masks.append(batch.mask) or backward(policy, batch, *args,
                                                                                                    **kwargs))
    rollouts, logged, _ = tool_step(model_folder, "auto")
    check_metrics(rollouts, logged)
    assert torch.equal(masks[0], rollouts.completion_mask[:, 1:].bool())
    assert not masks[0][rollouts.environment_mask[:, 1:].bool()].any()


def test_completion_tables_show_whole_transcripts():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    conversation = Conversation(messages=[{"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "tool", "name": "add", "content": "5"},
                                          {"role": "assistant", "content": "It is 5"}], turns=2, tool_calls=1)
    rollouts = pack_rollouts([[1]], [[2, 3, 4]], [[-1.0, 0.0, -1.0]], ["It is 5"], [True], pad_token_id=0,
                             environment_masks=[[0, 1, 0]], conversations=[conversation])
    scores = RewardScores([1.0], {"math_reward": [1.0]}, failures=0, unscored=0)
    table = completion_table(ScoredRollouts(rollouts, {"prompt_text": ["q"], "answer": ["5"]}, scores,
                                            torch.tensor([1.0])), step=0, count=1)
    assert table["completion"] == ['[assistant]\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n[tool add]\n5\n'
                                   '[assistant]\nIt is 5']
    assert (table["length"], table["turns"], table["tool_calls"], table["tool_failures"]) == ([2], [2], [1], [0])


def test_the_tools_listing_counts_against_the_models_positions(model_folder):
    grpo = grpo_module(model_folder, tools=["tests.helpers.tools:add"])  # max_new_tokens 6
    grpo.model_config.max_position_embeddings = 200  # a plain prompt fits; with the tools listed none does
    listing = grpo.multi_turn.tool_prompt_tokens()
    with pytest.raises(ValueError, match=rf"rollout.max_new_tokens = 6 and the {listing} tokens listing the tools "
                                         r"leave no room for a prompt in the model's 200 positions"):
        fit_grpo(grpo, model_folder, steps=1)


def test_an_environments_reward_is_one_more_source(model_folder):
    guess = '<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call>'
    rollouts, logged, _ = tool_step(model_folder, "auto", turns=[guess, "done"],
                                    environment_factory="tests.helpers.tools:GuessEnvironment")
    rewards = [conversation.environment_reward for conversation in rollouts.conversations]
    assert [c.messages[1]["name"] for c in rollouts.conversations] == ["guess"] * 4
    assert logged["reward/GuessEnvironment/mean"] == pytest.approx(sum(rewards) / 4)
    assert logged["tools/calls_per_sample"] == 1.0 and logged["turns/mean"] == 2.0


def test_validation_logs_the_tool_call_rate(model_folder):
    grpo = grpo_module(model_folder, multi_turn=MultiTurnConfig(max_turns=2), tools=["tests.helpers.tools:add"],
                       rollout=RolloutConfig(num_generations=2, max_new_tokens=600, val_generations=2))
    grpo.configure_model()
    # Two validation batches of 2 prompts x 2 conversations, two turns each: the first turn's
    # call runs (in batch 0 on one conversation of 4, in batch 1 on all), the last turn's never does.
    ScriptedGeneration(grpo.policy, grpo.tokenizer, [[CALL, "7", "7", "7"], "5", CALL, CALL])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                               enable_model_summary=False).validate(grpo, prompt_data(model_folder))
    assert metrics["val/tools/calls_per_sample"] == pytest.approx((1 + 4) / 8)
