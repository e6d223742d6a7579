"""The frontier protocol's arithmetic and report on fake runs: interpolation at a KL level,
which step size a method's frontier takes, the crossed bootstrap and the t interval, and the
verdicts the report states."""

import random
import statistics

import pytest

from benchmarks import frontier_protocol as fp
from benchmarks.frontier_report import method_seeds, render, summarise
from benchmarks.paired_stats import bootstrap_interval, crossed_bootstrap_interval, seed_mean, t_interval


def test_at_level_interpolates_each_prompt_linearly_in_kl_at_the_first_crossing():
    path = [(0.0, [0.0, 1.0]), (0.01, [0.5, 1.0]), (0.03, [1.0, 0.5]), (0.02, [0.0, 0.0])]
    assert fp.at_level(path, 0.005) == [0.25, 1.0]
    assert fp.at_level(path, 0.02) == [0.75, 0.75]  # first crossing: between 0.01 and 0.03, not the later 0.02
    assert fp.at_level(path, 0.01) == [0.5, 1.0]
    assert fp.at_level(path, 0.05) is None


def test_sweeps_span_ten_times_in_four_points():
    for values in fp.SWEEPS.values():
        assert len(values) == 4 and values[-1] / values[0] == pytest.approx(10, rel=0.01)


def fake_result(gains: dict, kl_per_step: dict, seeds=(0, 1), prompts=4, digest="same"):
    """Runs whose KL from init grows linearly with the step (``kl_per_step[(method, value)]``)
    and whose pass@1 gain over the untrained 0.25 grows linearly with the KL up to
    ``gains[(method, value)]`` at the last validation; per prompt, all alike."""
    result = {"untrained": [], "runs": [], "parts": [], "smoke": False}
    for seed in seeds:
        result["untrained"].append({"task": "addition", "seed": seed, "seconds": 1.0, "prompts_digest": digest,
                                    "correct": [1] * prompts, "pass_at_1": 0.25})
    for method, values in fp.SWEEPS.items():
        for value in values:
            for seed in seeds:
                validations = []
                for step in (4, 8, 12):
                    fraction = 0.25 + gains[(method, value)] * step / 12
                    correct = [round(4 * fraction)] * prompts
                    validations.append({"step": step, "prompts_digest": digest, "correct": correct,
                                        "pass_at_1": sum(correct) / (4 * prompts), "kl_from_init": kl_per_step[(method, value)] * step})
                result["runs"].append({"task": "addition", "kind": "sweep", "method": method, "value": value,
                                       "setting": fp.setting(method, value), "seed": seed, "steps": 12, "seconds": 10.0,
                                       "validations": validations, "reward_mean": [(0, 0.1, 1.0)],
                                       "step_kl": [(0, 1e-3, 1.0)]})
    return result


def test_the_frontier_takes_the_best_step_size_that_reaches_the_level():
    gains = {(m, v): 0.0 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-4 for m, values in fp.SWEEPS.items() for v in values}
    dense_small, dense_large = fp.SWEEPS["dense"][0], fp.SWEEPS["dense"][3]
    gains[("dense", dense_small)], kl[("dense", dense_small)] = 0.75, 1e-3  # reaches 0.012 at step 12
    gains[("dense", dense_large)], kl[("dense", dense_large)] = 0.25, 1e-2  # reaches 0.12
    result = fake_result(gains, kl)
    # At 0.012 both reach: the small lr is better there (pass@1 0.25 + 0.75 = 1.0 at step 12).
    point = fp.frontier_point(result, "addition", "dense", 0.012, seeds=(0, 1))
    assert point["value"] == dense_small and point["pass_at_1"] == pytest.approx(1.0)
    # At 0.1 only the large lr gets there: between steps 8 and 12 (KL 0.08 -> 0.12): correct 2 -> 2 of 4.
    point = fp.frontier_point(result, "addition", "dense", 0.1, seeds=(0, 1))
    assert point["value"] == dense_large and point["pass_at_1"] == pytest.approx(0.5)
    assert fp.frontier_point(result, "addition", "dense", 0.5, seeds=(0, 1)) is None
    assert fp.chosen_value(result, "addition", "dense", seeds=(0, 1)) == dense_small
    # The long runs choose on the seeds that have every sweep run (here 2 of the protocol's 5).
    assert fp.chosen_value(result, "addition", "dense") is None
    assert method_seeds(result, "addition", "dense") == [0, 1]


def test_the_report_states_the_gain_ratio_verdict_at_each_reached_level():
    gains = {(m, v): 0.25 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-3 for m, values in fp.SWEEPS.items() for v in values}
    result = fake_result(gains, kl, seeds=(0, 1, 2, 3, 4))
    summary = summarise(result, "addition")
    assert summary["seeds"] == [0, 1, 2, 3, 4] and summary["crossed"]  # one digest: the prompts are shared
    assert sorted(summary["levels"]) == [1e-3, 2e-3, 5e-3, 1e-2]  # KL reaches 0.012 at step 12
    pair = summary["levels"][5e-3]["pairs"]["logra-dense"]
    assert pair["difference_points"] == pytest.approx(0.0) and pair["gain_ratio"] == pytest.approx(1.0) and pair["met"]
    text = render(result)
    assert "| 0.005 | LoGRA - dense AdamW | 5 | +0.0 |" in text and "| met |" in text


def test_each_method_uses_the_seeds_with_all_its_runs_and_a_pair_those_both_have():
    gains = {(m, v): 0.25 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-3 for m, values in fp.SWEEPS.items() for v in values}
    result = fake_result(gains, kl, seeds=(0, 1, 2))
    # Seed 2 has LoGRA and dense only, and LoRA lacks one step size there.
    result["runs"] = [r for r in result["runs"] if not (r["seed"] == 2 and (r["method"] == "dense_paper" or
                                                                            (r["method"], r["value"]) == ("lora", fp.SWEEPS["lora"][0])))]
    summary = summarise(result, "addition")
    assert summary["seeds"] == [0, 1]
    assert summary["method_seeds"] == {"dense": [0, 1, 2], "dense_paper": [0, 1], "lora": [0, 1], "logra": [0, 1, 2]}
    entry = summary["levels"][5e-3]
    assert entry["methods"]["logra"]["seeds"] == [0, 1, 2] and entry["methods"]["lora"]["seeds"] == [0, 1]
    assert {name: pair["seeds"] for name, pair in entry["pairs"].items()} == {
        "logra-dense": [0, 1, 2], "logra-dense_paper": [0, 1], "logra-lora": [0, 1]}
    text = render(result)
    assert "| 0.005 | LoGRA - dense AdamW | 3 | +0.0 |" in text and "| 0.005 | LoGRA - LoRA r=256 | 2 | +0.0 |" in text


def test_crossed_bootstrap_of_a_prompt_effect_shared_by_the_seeds_is_wider_than_treating_seeds_apart():
    # Every seed sees the same prompts, and the prompts differ a lot: the nested bootstrap
    # treats each seed's prompts as a fresh sample (variance / (seeds x prompts)); the crossed
    # one draws the prompts once per resample (variance / prompts).
    generator = random.Random(3)
    prompt_effects = [generator.gauss(0, 1) for _ in range(20)]
    per_seed = [[effect + generator.gauss(0, 0.05) for effect in prompt_effects] for _ in range(5)]
    low, high = crossed_bootstrap_interval(per_seed, resamples=4000)
    nested_low, nested_high = bootstrap_interval(per_seed, resamples=4000)
    assert low < seed_mean(per_seed) < high
    assert (high - low) > 1.8 * (nested_high - nested_low)  # sqrt(5) = 2.24 in expectation
    with pytest.raises(ValueError, match="same, non-empty list of prompts"):
        crossed_bootstrap_interval([[0.1, 0.2], [0.3]])


def test_t_interval_over_seed_means():
    per_seed = [[1.0, 3.0], [4.0], [6.0, 6.0]]  # seed means 2, 4, 6: mean 4, sd 2
    low, high = t_interval(per_seed)
    half = 4.302652729911275 * 2 / 3 ** 0.5  # t(0.975, 2 degrees of freedom)
    assert low == pytest.approx(4 - half) and high == pytest.approx(4 + half)
    assert statistics.mean([low, high]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="two seeds"):
        t_interval([[1.0]])


def test_steps_to_reward_is_the_first_step_whose_trailing_mean_reaches_the_level():
    rewards = [(step, value, 0.0) for step, value in enumerate([0.0, 0.0, 1.0, 1.0, 0.0, 1.0], start=1)]
    assert fp.steps_to_reward(rewards, 0.5, window=2) == 3  # steps 2-3: 0.5
    assert fp.steps_to_reward(rewards, 1.0, window=2) == 4  # steps 3-4
    assert fp.steps_to_reward(rewards, 0.6, window=3) == 4  # steps 2-4: 0.67
    assert fp.steps_to_reward(rewards, 0.7, window=3) is None  # no 3 steps reach it
    assert fp.steps_to_reward(rewards, 0.7, window=4) == 6  # steps 3-6: 0.75
    assert fp.steps_to_reward(rewards[:1], 0.0, window=2) is None  # fewer steps than the window


def test_the_long_runs_report_time_to_each_reward_and_count_their_seconds_once():
    gains = {(m, v): 0.25 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-3 for m, values in fp.SWEEPS.items() for v in values}
    result = fake_result(gains, kl)
    before = render(result)
    rewards = [(step, min(1.0, step / 100), 0.0) for step in range(1, 301)]  # trailing 20-step mean: (step - 9.5) / 100
    result["runs"].append({"task": "addition", "kind": "long", "method": "logra", "value": 0.01, "setting": "budget=0.01",
                           "seed": 0, "steps": 300, "seconds": 3600.0, "reward_mean": rewards, "step_kl": [],
                           "validations": [{"step": 300, "pass_at_1": 0.5, "kl_from_init": 0.25}]})
    text = render(result)
    assert "| LoGRA | budget=0.01 | 300 | 0.500 | 0.25 | 60 / 70 / 80 / 90 | no --timing yet | 3600 |" in text
    hours = [float(t.split("Machine time so far: ")[1].split(" h")[0]) for t in (before, text)]
    assert hours[1] - hours[0] == pytest.approx(1.0, abs=0.01)  # the long run's hour, once
    result["runs"].append({"task": "addition", "kind": "timing", "method": "logra", "value": 0.01, "seed": 0,
                           "steps": 8, "seconds": 0.0, "step_s": 2.0, "reward_mean": [], "step_kl": []})
    assert "| 60 / 70 / 80 / 90 | 120 / 140 / 160 / 180 | 3600 |" in render(result)
