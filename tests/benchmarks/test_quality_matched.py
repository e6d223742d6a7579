"""quality_matched's planning and report on fake runs: which runs a part makes, in which
order, how the selection and the KL-matched budget are chosen, and what is reported."""

import json

import pytest

from benchmarks import quality_matched as qm
from benchmarks import quality_matched_protocol as qm_protocol
from benchmarks.quality_matched_report import render, summarise

PROMPTS = [f"prompt {i}" for i in range(8)]


class FakeRuns:
    """Stands in for the CLI: a run's final pass@1 is ``finals[(method, value)]`` on every
    seed (per prompt: that many of 4 samples right, spread over the prompts), its step KL
    ``value / 10``."""

    task = "arithmetic"

    def __init__(self, finals, digest=None):
        self.finals, self.digest, self.calls = finals, digest, []

    def untrained(self, seed):
        self.calls.append(("untrained", seed))
        correct = [1] * 8
        return {"task": self.task, "seed": seed, "seconds": 5.0, "prompts": PROMPTS, "prompts_digest": qm.digest(PROMPTS),
                "correct": correct, "pass_at_1": 0.25}

    def train(self, method, value, seed):
        self.calls.append((method, value, seed))
        final = self.finals[(method, value)]
        correct = [round(4 * final)] * 8
        kl = (value or 1e-4) / 10
        return {"task": self.task, "method": method, "value": value, "setting": qm.setting(method, value), "seed": seed,
                "seconds": 100.0, "validations": [{"step": 24, "prompts_digest": self.digest or qm.digest(PROMPTS),
                                                   "correct": correct, "pass_at_1": sum(correct) / 32}],
                "val_pass_at_1": [(12, 0.25 + (final - 0.25) / 2, 50.0), (24, final, 100.0)],
                "reward_mean": [(0, 0.1, 10.0), (1, final, 20.0)], "step_kl": [(0, kl, 10.0), (1, 3 * kl, 20.0)]}


FINALS = {("dense", 3e-6): 0.25, ("dense", 1e-5): 0.5, ("dense", 3e-5): 0.75, ("dense", 9e-5): 0.5,
          ("logra", 2e-3): 0.5, ("logra", 5e-3): 0.75, ("logra", 1.25e-2): 0.5, ("logra_matched", 6e-6): 0.75}


def protocol(tmp_path, runs):
    result = {"untrained": [], "runs": [], "notes": [], "screening": [], "parts": [], "smoke": False}
    return result, qm.Protocol(result, tmp_path / "quality_matched.json", runs)


def test_a_part_sweeps_on_the_selection_seed_extends_an_edge_and_matches_dense_step_kl(tmp_path):
    runs = FakeRuns(FINALS)
    result, plan = protocol(tmp_path, runs)
    plan.part(["logra_matched"], [0])
    trained = [call for call in runs.calls if call[0] != "untrained"]
    # dense's best (3e-5) sat at the edge: one more point, 9e-5, was worse; then the matched run.
    assert trained == [("dense", 3e-6, 100), ("dense", 1e-5, 100), ("dense", 3e-5, 100), ("dense", 9e-5, 100),
                       ("logra_matched", 6e-6, 0)]
    # The budget is the median step KL of dense's best selection run: median(3e-6, 9e-6) = 6e-6.
    assert qm_protocol.matched_budget(result, "arithmetic") == 6e-6
    assert result["notes"] == ["arithmetic: dense's best lr=3e-05 at the edge of its sweep; extended to lr=9e-05"]
    assert ("untrained", 100) in runs.calls and ("untrained", 0) in runs.calls
    saved = json.loads((tmp_path / "quality_matched.json").read_text())
    assert len(saved["runs"]) == 5  # saved after every run

    plan.part(["logra_matched"], [0])  # everything is there: a second invocation runs nothing
    assert len(runs.calls) == 2 + 5


def test_the_report_pairs_methods_prompt_by_prompt(tmp_path):
    runs = FakeRuns({**FINALS, ("dense_paper", None): 0.25})
    result, plan = protocol(tmp_path, runs)
    plan.part(["dense", "dense_paper", "logra", "logra_matched"], [0, 1])
    summary = summarise(result, "arithmetic")
    dense, logra = summary["methods"]["dense"], summary["methods"]["logra"]
    assert dense["setting"] == "lr=3e-05" and logra["setting"] == "budget=0.005"
    assert dense["gain_points"] == logra["gain_points"] == 50.0  # 0.75 - 0.25 on every prompt
    assert dense["gain_interval_points"] == pytest.approx([50.0, 50.0])
    assert summary["methods"]["dense_paper"]["gain_points"] == 0.0
    # +25 points reached at the step-12 validation (0.5) on both seeds.
    assert dense["steps_to_threshold"] == [12, 12] and dense["median_seconds_to_threshold"] == 50.0
    assert summary["methods"]["dense_paper"]["median_steps_to_threshold"] is None
    pair = summary["pairs"]["logra-dense"]
    assert pair["difference_points"] == 0.0 and pair["width_met"] and pair["not_worse"]
    table = render({**result, "parts": []})
    assert "Paired difference logra - dense (seeds 0, 1): +0.0 points [+0.0, +0.0]" in table
    assert "gain ratio 1.00; targets pending until seeds 0, 1, 2 are in." in table  # 2 of 3 seeds: not judged
    assert "| dense_paper | paper recipe | 0, 1 | +0.0 [+0.0, +0.0]" in table


def test_a_task_with_only_selection_runs_says_so_instead_of_an_empty_table(tmp_path):
    result, plan = protocol(tmp_path, FakeRuns(FINALS))
    plan.sweep("dense")  # a part stopped after its selection: nothing reported yet
    table = render({**result, "parts": []})
    assert "| dense | lr=1e-05 | 0.500 |" in table
    assert "No reported run yet." in table and "gain (points)" not in table


def test_a_run_validated_on_other_prompts_stops_the_protocol(tmp_path):
    _, plan = protocol(tmp_path, FakeRuns({("dense_paper", None): 0.5}, digest="something else"))
    with pytest.raises(SystemExit, match="validated on other prompts"):
        plan.part(["dense_paper"], [0])


def test_method_overrides_say_what_each_row_is():
    assert qm.method_overrides("logra_matched", 8.6e-3) == [
        "--trainer.strategy.init_args.logra.kl_budget=0.0086", "--trainer.strategy.init_args.logra.kl_budget_final=0.0086"]
    assert "--model.init_args.optimizer.betas=[0.0,0.95]" in qm.method_overrides("dense_no_momentum", 1e-5)
    assert "--trainer.strategy.init_args.logra.probe_responses=8" in qm.method_overrides("logra_probe8", 5e-3)
    assert "--model.init_args.optimizer.warmup_steps=9" in qm.method_overrides("dense_paper", None)


def test_a_resumed_part_does_not_extend_a_sweep_again(tmp_path):
    # The extension (9e-5) is the best point, at the edge again: one extension is the limit,
    # in the part that made it and in every later one.
    runs = FakeRuns({**FINALS, ("dense", 9e-5): 1.0, ("dense", 2.7e-4): 1.0, ("logra_matched", 6e-6): 0.5})
    result, plan = protocol(tmp_path, runs)
    plan.part(["dense"], [])
    plan.part(["dense"], [])
    assert [call for call in runs.calls if call[0] == "dense"] == [("dense", v, 100) for v in (3e-6, 1e-5, 3e-5, 9e-5)]
    assert qm_protocol.selected_value(result, "arithmetic", "dense") == 9e-5


def test_ablations_run_at_the_rows_they_change_one_thing_of_and_are_reported_as_a_diagnosis(tmp_path):
    runs = FakeRuns({**FINALS, ("dense_no_momentum", 3e-5): 0.5, ("logra_probe8", 6e-6): 0.5})
    result, plan = protocol(tmp_path, runs)
    plan.part(["dense", "logra_matched", "dense_no_momentum", "logra_probe8"], [0])
    reported_runs = [call for call in runs.calls if call[0] != "untrained" and call[2] != qm_protocol.SELECTION_SEED]
    # No LoGRA sweep: the probe ablation runs at the KL-matched budget, momentum's at dense's lr.
    assert not [call for call in runs.calls if call[0] == "logra"]
    assert reported_runs == [
        ("dense", 3e-5, 0), ("logra_matched", 6e-6, 0), ("dense_no_momentum", 3e-5, 0), ("logra_probe8", 6e-6, 0)]
    pairs = summarise(result, "arithmetic")["pairs"]
    assert pairs["logra_probe8-logra_matched"]["difference_points"] == -25.0  # 0.5 - 0.75 on every prompt
    assert pairs["logra_matched-dense_no_momentum"]["difference_points"] == 25.0
    table = render({**result, "parts": []})
    assert "Ablation logra_probe8 - logra_matched (seeds 0): -25.0 points [-25.0, -25.0]; gain ratio 0.50." in table
    assert "Paired difference logra_matched - dense (seeds 0)" in table
