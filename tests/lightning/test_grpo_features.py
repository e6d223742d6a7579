"""GRPOModule's RL options: several updates per rollout batch, importance sampling, DAPO and
GSPO options, TRL rewards and completion tables, on a tiny random Qwen2 (dense AdamW unless
the test is about LoGRA)."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import MLFlowLogger

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.data import PromptDataModule
from lightning_logra.modules import BatchingConfig, LoggingConfig, LossConfig, RewardConfig, RolloutConfig
from lightning_logra.rewards.runner import RewardWarning
from tests.helpers.architectures import save_with_byte_tokenizer, tiny_opt
from tests.helpers.grpo import SEEN, TableLogger, fit_grpo, grpo_module, reward_config, rewards
from tests.helpers.lightning import record_step_inputs
from tests.helpers.models import favour_token


def test_several_updates_per_rollout_batch_clip_against_the_sampling_weights(model_folder):
    grpo = grpo_module(model_folder, batching=BatchingConfig(micro_batch_size=2, num_iterations=2, mini_batches=2),
                       reward=reward_config("varied_reward"))
    grpo.optimizer_config.lr = 3e-2  # large steps, so the second pass leaves the trust region
    trainer, logged = fit_grpo(grpo, model_folder, steps=4)
    assert trainer.global_step == 4 and len(logged) == 1  # one rollout batch, 4 optimizer steps
    assert logged[0]["train/updates"] == 4
    assert logged[0]["policy/clip_fraction"] > 0  # the ratio moved away from 1: "old" is the sampling pass


def test_one_update_never_clips(model_folder):
    grpo = grpo_module(model_folder, reward=reward_config("varied_reward"))
    grpo.optimizer_config.lr = 3e-2
    _, logged = fit_grpo(grpo, model_folder, steps=2)
    assert all(step["policy/clip_fraction"] == 0 for step in logged)
    # HF engine, temperature 1, no truncation: rollout and trainer score the same distribution.
    assert all(step["policy/rollout_trainer_logprob_gap_abs"] < 1e-5 for step in logged)


def test_each_mini_batch_is_one_logra_update_seen_by_the_kl_controller(model_folder):
    grpo = grpo_module(model_folder, batching=BatchingConfig(micro_batch_size=2, mini_batches=2),
                       reward=reward_config("varied_reward"))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    recorded = record_step_inputs(strategy)
    reports = []

    class Reports(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if not reports:  # wrap the strategy's one-call update once it exists
                step = trainer.strategy.runtime.step
                trainer.strategy.runtime.step = lambda *a, **k: reports.append(step(*a, **k)) or reports[-1]

    trainer, logged = fit_grpo(grpo, model_folder, steps=4, strategy=strategy,
                               callbacks=[LoGRACallback(), Reports()])
    assert trainer.global_step == 4 and len(logged) == 2
    assert strategy.logra_optimizer.update_count == 4
    assert [inputs.probe.rows for inputs in recorded] == [2, 2, 2, 2]  # each update probes its own prompt group
    assert len(reports) == 4 and all(r.alpha is not None and r.budget is not None and not r.skipped for r in reports)


def packed_or_padded_step(folder, micro_batch_tokens=None) -> dict[str, float]:
    """The metrics of one logra_fsdp step with a KL reference and two updates (old
    log-probs), micro-batches of 2 rows or packed by ``micro_batch_tokens``, and whether
    every update's KL probe was packed."""
    batching = BatchingConfig(micro_batch_size=2, micro_batch_tokens=micro_batch_tokens, num_iterations=2)
    grpo = grpo_module(folder, batching=batching, loss=LossConfig(kl_coef=0.1))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    recorded = record_step_inputs(strategy)
    _, logged = fit_grpo(grpo, folder, steps=2, strategy=strategy, callbacks=[LoGRACallback()])
    return {**logged[0], "probe_packed": float(all(inputs.probe.packed for inputs in recorded))}


def test_micro_batches_by_tokens_train_as_the_padded_ones_do(model_folder):
    padded = packed_or_padded_step(model_folder)
    packed = packed_or_padded_step(model_folder, micro_batch_tokens=64)
    for key in ("policy/kl", "policy/clip_fraction", "policy/entropy", "policy/rollout_trainer_logprob_gap",
                "reward/mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key
    assert packed["probe_packed"] == 1.0 and padded["probe_packed"] == 0.0


def test_mini_batches_must_divide_the_prompts(model_folder):
    grpo = grpo_module(model_folder, batching=BatchingConfig(micro_batch_size=2, mini_batches=3),
                       reward=reward_config("varied_reward"))
    with pytest.raises(ValueError, match="mini_batches = 3 must divide the 2 prompts"):
        fit_grpo(grpo, model_folder, steps=1)


def test_truncated_importance_sampling_is_on_for_vllm_and_when_asked(model_folder):
    assert grpo_module(model_folder, rollout=RolloutConfig(engine="vllm", num_generations=2))._micro_batching.tis
    assert not grpo_module(model_folder)._micro_batching.tis
    grpo = grpo_module(model_folder, loss=LossConfig(tis=True, tis_cap=2.0), reward=reward_config("varied_reward"))
    _, logged = fit_grpo(grpo, model_folder, steps=1)
    assert logged[0]["policy/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # HF engine: ratios ~1
    assert logged[0]["policy/tis_capped_fraction"] == 0


def test_vllm_rollouts_refuse_truncated_sampling():
    # vLLM's log-probs would be the truncated distribution's, the trainer's the full one
    with pytest.raises(ValueError, match=r"RolloutConfig.top_p = 0.9 is invalid: must be 1.0 with engine='vllm'"):
        RolloutConfig(engine="vllm", top_p=0.9)
    with pytest.raises(ValueError, match=r"RolloutConfig.top_k = 5 is invalid: must be 0 with engine='vllm'"):
        RolloutConfig(engine="vllm", top_k=5)
    RolloutConfig(engine="vllm", val_top_p=0.7)  # validation may truncate: its log-probs are not used


def test_gspo_moves_the_weights_and_logs_its_clip_fraction(model_folder):
    grpo = grpo_module(model_folder, loss=LossConfig(type="gspo", epsilon_low=3e-4, epsilon_high=4e-4),
                       reward=reward_config("varied_reward"))
    grpo.configure_model()  # the weights now, to change or compare before the fit
    before = [p.detach().clone() for p in grpo.policy.parameters()]
    _, logged = fit_grpo(grpo, model_folder, steps=1)
    assert any(not torch.equal(a, b) for a, b in zip(before, grpo.policy.parameters()))
    assert "policy/clip_fraction" in logged[0]


def test_dynamic_sampling_replaces_groups_without_signal(model_folder):
    grpo = grpo_module(model_folder, rollout=RolloutConfig(num_generations=2, max_new_tokens=6, dynamic_sampling=True,
                                                           max_sampling_rounds=4), reward=reward_config("odd_answer_reward"))
    _, logged = fit_grpo(grpo, model_folder, steps=3)
    assert sum(step["sampling/dropped_groups"] for step in logged) > 0
    assert sum(step["sampling/extra_rounds"] for step in logged) > 0
    for step in logged:
        if step["sampling/unfilled_groups"] == 0:
            assert step["reward/zero_std_groups"] == 0


def test_mask_truncated_leaves_cut_off_completions_out(model_folder):
    grpo = grpo_module(model_folder, loss=LossConfig(mask_truncated=True), reward=reward_config("varied_reward"))
    grpo.configure_model()  # the weights now, to change or compare before the fit
    with torch.no_grad():
        favour_token(grpo.policy, grpo.tokenizer.eos_token_id, 2.0)  # some completions stop, some are cut off
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    recorded = record_step_inputs(strategy)
    _, logged = fit_grpo(grpo, model_folder, steps=1, strategy=strategy)
    inputs = recorded[-1]
    cut_off = ~inputs.logprob_pairs.mask.any(dim=1)
    assert cut_off.any() and not cut_off.all(), "this seed's rollouts mix stopped and cut-off completions"
    probed = inputs.probe.logits_mask  # rows one sample per prompt first: [p0 g0, p1 g0, ..., p0 g1, ...]
    cut_off = cut_off[torch.arange(len(cut_off)).view(-1, 2).T.reshape(-1)]
    assert not probed[cut_off].any()  # neither trained on nor probed
    assert probed[~cut_off].any(dim=1).all()
    assert logged[0]["completion/clipped_fraction"] > 0 and logged[0]["train/updates"] == 1


def test_a_run_with_nothing_to_train_on_stops_with_a_clear_error(model_folder):
    grpo = grpo_module(model_folder, loss=LossConfig(mask_truncated=True), reward=reward_config("varied_reward"))
    eos = torch.tensor([grpo.tokenizer.eos_token_id])
    grpo.configure_model()  # the weights now, to change or compare before the fit
    grpo.policy.lm_head.register_forward_hook(lambda head, args, logits: logits.index_fill(-1, eos, float("-inf")))
    before = [p.detach().clone() for p in grpo.policy.parameters()]
    with pytest.raises(RuntimeError, match="8 updates in a row had no completion token to train on"):
        fit_grpo(grpo, model_folder, steps=2)
    # EOS cannot be sampled, every completion is cut off: nothing was trained, no weight moved
    assert all(torch.equal(a, b) for a, b in zip(before, grpo.policy.parameters()))


def test_overlong_penalty_lowers_the_reward_of_long_completions(model_folder):
    # Zero task reward and a buffer as long as the limit: reward = -length / max_new_tokens.
    grpo = grpo_module(model_folder, loss=LossConfig(overlong_buffer=6, overlong_penalty=1.0), reward=reward_config("zero_reward"))
    _, logged = fit_grpo(grpo, model_folder, steps=1)
    assert logged[0]["reward/mean"] == pytest.approx(-logged[0]["completion/length_mean"] / 6, rel=1e-6)


def test_overlong_buffer_longer_than_the_limit_is_refused(model_folder):
    with pytest.raises(ValueError, match=r"GRPOModule.loss.overlong_buffer = 7 is invalid: must be <= rollout.max_new_tokens = 6"):
        grpo_module(model_folder, loss=LossConfig(overlong_buffer=7))


def test_reward_functions_get_trl_arguments_and_per_function_metrics(model_folder):
    grpo = grpo_module(model_folder, reward=RewardConfig(functions=rewards("recording_reward")
                                                            + ["trl.rewards:think_format_reward"]))
    _, logged = fit_grpo(grpo, model_folder, steps=1, data_options={"conversational": True})
    assert SEEN["completions"][0][0]["role"] == "assistant"  # conversational prompts: message completions
    assert SEEN["prompts"][0][-1]["role"] == "user"
    assert len(SEEN["answer"]) == len(SEEN["completion_ids"]) == 4
    assert all(isinstance(ids, list) and ids for ids in SEEN["completion_ids"])
    assert logged[0]["reward/recording_reward/mean"] == 0.5 and logged[0]["reward/recording_reward/std"] == 0
    assert logged[0]["reward/think_format_reward/mean"] == 0.0  # a random model writes no <think>
    assert logged[0]["reward/failures"] == 0


def test_completion_tables_go_to_mlflow_and_table_loggers(model_folder, tmp_path):
    grpo = grpo_module(model_folder, reward=reward_config("varied_reward"),
                       logging=LoggingConfig(completions_every=2, completions_count=3))
    mlflow_logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "art"))
    table_logger = TableLogger()
    fit_grpo(grpo, model_folder, steps=3, loggers=[mlflow_logger, table_logger])
    assert [step for *_, step in table_logger.tables] == [0, 2]
    key, columns, data, _ = table_logger.tables[0]
    assert columns == ["step", "prompt", "completion", "answer", "reward", "reward/varied_reward", "length", "truncated"]
    assert len(data) == 3 and all(len(row) == len(columns) for row in data)
    artifacts = mlflow_logger.experiment.list_artifacts(mlflow_logger.run_id, "completions")
    assert sorted(Path(a.path).name for a in artifacts) == ["step_000000.json", "step_000002.json"]
    local = mlflow_logger.experiment.download_artifacts(mlflow_logger.run_id, "completions/step_000000.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == columns and len(table["data"]) == 3


def validate_logged(grpo, folder, tmp_path, name):
    logger = MLFlowLogger(run_name=name, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=str(tmp_path / "art"))
    data = PromptDataModule(train="arithmetic", val="arithmetic", tokenizer=folder, batch_size=3, train_size=16, val_size=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    return logger, trainer.validate(grpo, datamodule=data, verbose=False)[0]


def test_every_validation_sample_goes_to_mlflow_as_one_table_per_validation(model_folder, tmp_path):
    logger, metrics = validate_logged(grpo_module(model_folder, logging=LoggingConfig(val_completions=True)), model_folder, tmp_path, "on")
    local = logger.experiment.download_artifacts(logger.run_id, "val_completions/step_000000.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "answer", "reward", "reward/varied_reward", "length", "truncated"]
    rows = table["data"]
    assert len(rows) == 5 * 2  # every prompt (two batches: 3 + 2) x val_generations samples, in prompt order
    prompts = [row[1] for row in rows]
    assert prompts[0::2] == prompts[1::2] and len(set(prompts)) == 5
    # The table's rewards give back the logged pass@1 (a sample is correct when its reward is > 0).
    per_prompt = [(rows[i][4] > 0) / 2 + (rows[i + 1][4] > 0) / 2 for i in range(0, len(rows), 2)]
    assert metrics["val/pass_at_1"] == pytest.approx(sum(per_prompt) / 5, abs=1e-6)

    logger, _ = validate_logged(grpo_module(model_folder), model_folder, tmp_path, "off")
    assert logger.experiment.list_artifacts(logger.run_id, "val_completions") == []  # off by default


NO_ANSWERS = {"field_map": {"answer": "solution"}}  # the reference answers land in another column


def test_the_math_reward_refuses_data_without_answers_naming_the_column_and_field_map(model_folder):
    grpo = grpo_module(model_folder, reward=None)  # the built-in math reward
    with pytest.raises(ValueError, match=r"arithmetic: no train row has an 'answer' column, which the built-in math "
                                         r"reward compares completions with: .* field_map"):
        fit_grpo(grpo, model_folder, steps=1, data_options=NO_ANSWERS)


def test_a_batch_no_reward_function_scores_warns_once_naming_the_empty_column(model_folder):
    caught = []
    fit_grpo(grpo_module(model_folder, reward=reward_config("answer_reward")), model_folder, steps=2,
             data_options=NO_ANSWERS, caught_warnings=caught)
    unscored = [str(w.message) for w in caught if issubclass(w.category, RewardWarning)]
    assert len(unscored) == 1
    assert unscored[0].startswith("no reward function (answer_reward) scored any of the 4 samples of a batch")
    assert "the columns ['answer'] are None in every row" in unscored[0]


def test_prompts_past_the_models_positions_are_skipped_and_counted(model_folder, tmp_path):
    short_row, long_row = {"prompt": "What is 1 + 2?", "answer": "3"}, {"prompt": "What is " + "1 + " * 9 + "1?"}
    rows = [short_row] * 4 + [long_row] * 2
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PromptDataModule(train=tmp_path / "rows.jsonl", tokenizer=model_folder)
    data.setup("fit")
    short, _ = sorted({len(ids) for ids in data.tokenizer(data.datasets["train"].prompt_texts)["input_ids"]})
    grpo = grpo_module(model_folder)  # max_new_tokens 6
    grpo.model_config.max_position_embeddings = short + 6
    trainer, _ = fit_grpo(grpo, model_folder, steps=1, data_options={"train": tmp_path / "rows.jsonl", "val": None})
    assert trainer.datamodule.skipped["train"]["too_long"] == 2
    assert trainer.datamodule.datasets["train"].prompt_texts == data.datasets["train"].prompt_texts[:4]


def test_data_whose_every_prompt_is_past_the_models_positions_is_refused(model_folder):
    grpo = grpo_module(model_folder)
    grpo.model_config.max_position_embeddings = 20  # 14 for a prompt; the shortest arithmetic one is 34 here
    with pytest.raises(ValueError, match=r"arithmetic: every train prompt is longer than 14 tokens \(the model's 20 "
                                         r"positions less rollout.max_new_tokens = 6\); the shortest has 3\d"):
        fit_grpo(grpo, model_folder, steps=1)


def test_max_new_tokens_filling_the_models_positions_is_refused(model_folder):
    grpo = grpo_module(model_folder)
    grpo.model_config.max_position_embeddings = 6
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens = 6 leaves no room for a prompt in the model's 6 "
                                         r"positions"):
        fit_grpo(grpo, model_folder, steps=1)


@pytest.mark.parametrize("method", ["dense", "lora", "logra"])
def test_step_kl_logs_how_far_each_step_moved_the_policy(model_folder, method):
    from lightning_logra.modules import LoRAConfig

    options = {"lora": LoRAConfig(rank=4, alpha=8.0)} if method == "lora" else {}
    grpo = grpo_module(model_folder, reward=reward_config("varied_reward"), **options)  # step_kl: on by default
    strategy, callbacks, measured = "auto", [], []
    if method == "logra":
        strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, kl_budget=1e-3, kl_budget_final=1e-3))

        class MeasuredKL(L.Callback):  # after LoGRACallback, which logs it at the batch's end
            def on_train_batch_end(self, trainer, *args):
                measured.append(float(trainer.callback_metrics["logra/measured_kl"]))

        callbacks = [LoGRACallback(measure_kl=True), MeasuredKL()]
    _, logged = fit_grpo(grpo, model_folder, steps=2, strategy=strategy, callbacks=callbacks)
    for index, step in enumerate(logged):
        assert step["policy/step_kl"] > 0 and step["perf/step_kl_s"] > 0
        if method == "logra":
            # Two estimates of one quantity: the exact KL on the probe's rows (all 4 here, at
            # most 8 are probed) and k3 at 4 fresh tokens per trained position of the same
            # rows; on a few dozen positions the token draws leave tens of percent between them.
            assert 0.5 < step["policy/step_kl"] / measured[index] < 2


def test_step_kl_is_not_measured_when_turned_off(model_folder):
    _, logged = fit_grpo(grpo_module(model_folder, logging=LoggingConfig(step_kl=False)), model_folder, steps=1)
    assert "policy/step_kl" not in logged[0] and "perf/step_kl_s" not in logged[0]


def test_packing_is_refused_at_the_start_of_fit_for_a_model_that_packs_wrongly(tmp_path):
    folder = save_with_byte_tokenizer(tiny_opt(), tmp_path)
    with pytest.raises(ValueError, match=r"OPTForCausalLM: packed log-probs differ .*unset batching.micro_batch_tokens"):
        fit_grpo(grpo_module(folder, batching=BatchingConfig(micro_batch_size=2, micro_batch_tokens=64)), folder, steps=1)
    trainer, _ = fit_grpo(grpo_module(folder), folder, steps=1)  # padded micro-batches train it
    assert trainer.global_step == 1


def test_kl_from_init_is_zero_before_training_and_leaves_training_as_it_was(model_folder, tmp_path):
    # Validation of the untrained policy: it is its initial weights, so exactly 0.
    _, metrics = validate_logged(grpo_module(model_folder, logging=LoggingConfig(kl_from_init=True)), model_folder,
                                 tmp_path, "kl_from_init")
    assert metrics["val/kl_from_init"] == 0.0
    # The frozen initial weights only measure: with kl_coef 0 the training loss never reads them.
    with_kl, _ = fit_grpo(grpo_module(model_folder, logging=LoggingConfig(kl_from_init=True)), model_folder, steps=2)
    without, _ = fit_grpo(grpo_module(model_folder), model_folder, steps=2)
    assert with_kl.lightning_module.reference is not None and without.lightning_module.reference is None
    assert all(torch.equal(a, b) for a, b in zip(with_kl.lightning_module.policy.parameters(),
                                                  without.lightning_module.policy.parameters()))
    # Trained, the policy has moved from its initial weights, and the validation says how far.
    _, metrics = validate_logged(with_kl.lightning_module, model_folder, tmp_path, "trained")
    assert metrics["val/kl_from_init"] > 0


@pytest.mark.parametrize("method", ["dense", "lora", "logra"])
def test_the_peer_loss_options_train_under_every_method(model_folder, method):
    """Every option of issue 44 part 3 on at once (a KL penalty by low_var, an entropy bonus,
    sequence-masked importance sampling with a floor, the off-policy mask, length-scaled
    advantages): each method trains, logs the options' metrics, and moves the weights."""
    from lightning_logra.modules import LoRAConfig

    loss = LossConfig(kl_coef=0.05, kl_estimator="low_var", entropy_coef=0.01, tis=True,
                      importance_sampling_mode="sequence_mask", tis_cap=3.0, tis_min=0.5, off_policy_mask_threshold=0.5,
                      response_length_reference=4.0)
    options = {"lora": LoRAConfig(rank=4, alpha=8.0)} if method == "lora" else {}
    grpo = grpo_module(model_folder, loss=loss, **options)
    before = None
    if method == "dense":
        grpo.configure_model()  # built now, kept by fit
        before = {name: p.detach().clone() for name, p in grpo.policy.named_parameters()}
    strategy, callbacks = "auto", []
    if method == "logra":
        strategy, callbacks = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3)), [LoGRACallback()]
    trainer, logged = fit_grpo(grpo, model_folder, steps=2, strategy=strategy, callbacks=callbacks)
    assert trainer.global_step == 2
    for step in logged:
        assert 0 <= step["policy/off_policy_masked_fraction"] <= 1 and step["policy/tis_weight_mean"] > 0
        assert step["policy/kl"] >= 0
    if before is not None:
        assert any(not torch.equal(before[name], p) for name, p in grpo.policy.named_parameters())


def test_the_authors_success_threshold_maps_fractional_rewards_to_failures(model_folder):
    # varied_reward pays sevenths below 1: with the threshold every sample is a failure
    # (-0.01), so one step leaves the baseline at 0.1 x -0.01; without it, a positive mean.
    for threshold in (1.0, None):
        grpo = grpo_module(model_folder, loss=LossConfig(type="reinforce_baseline", success_threshold=threshold))
        _, logged = fit_grpo(grpo, model_folder, steps=1)
        if threshold is None:
            assert grpo.baseline.value > 0 and logged[0]["reward/mean"] > 0
        else:
            assert grpo.baseline.value == pytest.approx(-0.001)


def test_an_importance_sampling_option_without_importance_sampling_is_refused(model_folder):
    with pytest.raises(ValueError, match=r"loss.importance_sampling_mode = 'sequence_mask' has no effect: importance "
                                         r"sampling is off \(loss.tis = None, rollout.engine = 'hf'\)"):
        grpo_module(model_folder, loss=LossConfig(importance_sampling_mode="sequence_mask"))
    grpo_module(model_folder, loss=LossConfig(type="reinforce_baseline", tis_min=0.5))  # always weighted: accepted
