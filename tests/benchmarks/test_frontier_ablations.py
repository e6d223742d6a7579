"""The frontier's ablations on fake runs: each is compared at equal KL from init with the
default LoGRA run at the ablation budget (same seed, per prompt) and with the paper recipe's
frontier, at the levels it reaches on every seed it ran."""

import copy

import pytest

from benchmarks import frontier_ablations as fa
from benchmarks import frontier_protocol as fp
from benchmarks.frontier_report import render
from tests.benchmarks.test_frontier import fake_result


def with_ablation(result: dict, name: str, extra_correct: int, seeds=(0, 1, 2)) -> dict:
    """``result`` plus ablation ``name``: the default run at the ablation budget with
    ``extra_correct`` more of each prompt's 4 samples right at every validation."""
    for default in [r for r in result["runs"] if r["method"] == "logra" and r["value"] == fa.BUDGET and r["seed"] in seeds]:
        run = copy.deepcopy(default)
        run.update(kind="ablation", ablation=name)
        for validation in run["validations"]:
            validation["correct"] = [c + extra_correct for c in validation["correct"]]
        result["runs"].append(run)
    return result


def test_an_ablation_is_paired_with_the_default_run_and_the_paper_recipe_at_the_levels_it_reaches():
    gains = {(m, v): 0.25 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-3 for m, values in fp.SWEEPS.items() for v in values}
    kl[("logra", fa.BUDGET)] = 1.25e-3  # validations at KL 0.005, 0.01, 0.015: 0.02 is not reached
    result = with_ablation(fake_result(gains, kl, seeds=(0, 1, 2)), "rank_256", extra_correct=1)
    (summary,) = fa.summarise_ablations(result)
    assert summary["ablation"] == "rank_256" and summary["seeds"] == [0, 1, 2]
    assert sorted(summary["levels"]) == [1e-3, 2e-3, 5e-3, 1e-2]
    # One more of 4 right at every validation: +25 points there, and on the chord from the
    # untrained model (KL 0) to the first validation (KL 0.005), 0.2 and 0.4 of that.
    for level, expected in ((1e-3, 5.0), (2e-3, 10.0), (5e-3, 25.0), (1e-2, 25.0)):
        stats = summary["levels"][level]["minus_default"]
        assert stats["difference_points"] == pytest.approx(expected)
        assert stats["t_points"] == pytest.approx([expected, expected])  # every seed alike: no spread
    # Differences add up: ablation - paper recipe = (ablation - default) + (default - paper recipe).
    at = summary["levels"][5e-3]
    assert at["minus_paper"]["difference_points"] == pytest.approx(
        at["minus_default"]["difference_points"] + at["default_minus_paper"]["difference_points"])
    text = "\n".join(fa.render_ablations(result))
    assert "| rank 256 | 0, 1, 2 |" in text and "| 0.005 | rank 256 | +25.0 [+25.0, +25.0] [+25.0, +25.0] |" in text
    assert "### Ablations" in render(result)


def test_no_ablation_runs_render_nothing_and_an_ablation_missing_the_default_run_is_left_out():
    gains = {(m, v): 0.25 for m, values in fp.SWEEPS.items() for v in values}
    kl = {(m, v): 1e-3 for m, values in fp.SWEEPS.items() for v in values}
    result = fake_result(gains, kl, seeds=(0, 1))
    assert fa.summarise_ablations(result) == [] and fa.render_ablations(result) == []
    result = with_ablation(result, "fixed_projections", extra_correct=0, seeds=(0, 1))
    result["runs"] = [r for r in result["runs"] if not (r["kind"] == "sweep" and r["method"] == "logra"
                                                        and r["value"] == fa.BUDGET and r["seed"] == 1)]
    (summary,) = fa.summarise_ablations(result)
    assert summary["seeds"] == [0] and summary["levels"][5e-3]["minus_default"]["t_points"] == [None, None]
