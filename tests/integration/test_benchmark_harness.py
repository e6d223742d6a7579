"""The benchmarks' harness end to end: the speed and memory scripts' smoke runs replay the
library's GRPO step in every mode, and every committed result re-renders to the committed
tables. Runs ``python -m benchmarks.<name>`` from the repository root, as the README says;
the smoke runs use a tiny model and measure nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("dense", "lora", "logra")


def run(module: str, *arguments: str) -> subprocess.CompletedProcess:
    completed = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *arguments], cwd=ROOT,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def test_speed_smoke_run_times_the_replayed_grpo_step_of_every_mode(tmp_path):
    run("speed", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "speed.json").read_text())
    assert result["smoke"] is True and result["command"].startswith("python -m benchmarks.speed")
    row = result["rows"][0]
    assert row["step"].startswith("GRPOModule's step on replayed rollouts")
    assert all(len(row["samples"][mode]) == 2 and len(row["contention"][mode]) == 2 for mode in MODES)
    # Only LoGRA probes; its probe time is the StepReport's, inside its step.
    assert row["medians_s"]["logra"]["kl_probe"] > 0
    assert row["medians_s"]["dense"]["kl_probe"] == row["medians_s"]["lora"]["kl_probe"] == 0
    assert len(row["paired_logra_over_dense"]) == 2
    table = (tmp_path / "speed.md").read_text()
    assert "Smoke run on a tiny model" in table and "Step: GRPOModule's step" in table


@pytest.mark.slow  # 60 s; the speed, packing and loading smoke runs cover the harness in the default run
def test_memory_smoke_run_measures_each_mode_in_its_own_process(tmp_path):
    run("memory", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "memory.json").read_text())
    assert result["smoke"] is True and [run_["logprob_chunk"] for run_ in result["runs"]] == [256]
    modes = {row["mode"]: row for row in result["runs"][0]["modes"]}
    assert sorted(modes) == sorted(MODES)
    breakdown = {mode: row["breakdown_mib"] for mode, row in modes.items()}
    # LoGRA forms no weight gradient; its state is what LoGRAOptimizer.state_bytes() reports.
    assert breakdown["logra"]["gradients"] == 0 and breakdown["lora"]["gradients"] > 0 and breakdown["dense"]["gradients"] > 0
    state = modes["logra"]["optimizer_state_bytes"]
    assert set(state) == {"sketch_accumulator", "accumulation_scratch", "projections", "second_moments", "total"}
    assert breakdown["logra"]["logra_state"] == state["total"] / 2**20 > 0
    assert breakdown["dense"]["optimizer_state"] == modes["dense"]["optimizer_state_bytes"]["total"] / 2**20 > 0
    assert "Smoke run on a tiny model" in (tmp_path / "memory.md").read_text()


def test_packing_smoke_run_times_padded_and_packed_steps_side_by_side(tmp_path):
    run("packing", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "packing.json").read_text())
    assert result["smoke"] is True and result["command"].startswith("python -m benchmarks.packing")
    assert sorted(result["samples"]) == ["packed", "padded"] and result["micro_batches"]["padded"] == 2
    tokens = result["tokens_computed"]
    assert tokens["packed"] == tokens["real"] < tokens["padded"] == tokens["padded_batch"]
    assert result["tokens_equal_real"] is True and result["packed_over_padded"] > 0
    assert result["medians_s"]["packed"]["kl_probe"] > 0
    table = (tmp_path / "packing.md").read_text()
    assert "Smoke run on a tiny model" in table and "Packed / padded step" in table


@pytest.mark.slow  # 31 s; the speed, packing and fits smoke runs cover the harness in the default run
def test_loading_smoke_run_sets_up_two_ranks_with_and_without_a_reference(tmp_path):
    run("loading", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "loading.json").read_text())
    runs = [(run_["kl_coef"], run_["precision"]) for run_ in result["runs"]]
    assert result["smoke"] is True and runs == [(0.0, "32-true"), (0.1, "32-true"), (0.1, "bf16-mixed")]
    kept = [[rank["kept_shards_mib"] for rank in run_["ranks"]] for run_ in result["runs"]]
    # Each rank keeps half the policy, and half a reference in the compute dtype.
    assert kept[1][0] == 2 * kept[0][0] and kept[2][0] == 1.5 * kept[0][0]
    for run_ in result["runs"]:
        assert len(run_["ranks"]) == 2
        assert all(rank["setup_peak_mib"] > 0 and rank["seconds_to_first_step"] > 0 for rank in run_["ranks"])
    assert "Smoke run on a tiny model" in (tmp_path / "loading.md").read_text()


def test_fits_smoke_run_predicts_the_gpu_table_from_shapes(tmp_path):
    run("fits", "--smoke", "--table", "--out", str(tmp_path))
    result = json.loads((tmp_path / "fits.json").read_text())
    assert {(row["tokens"], row["method"]) for row in result["table"]} == {(t, m) for t in (4096, 16384) for m in MODES}
    assert all(row["peak"] == max(row["backward_peak"], row["update_peak"]) for row in result["table"])


@pytest.mark.slow  # 6 minutes: the table above keeps the prediction in the default run
def test_fits_smoke_run_measures_one_and_two_processes_and_searches(tmp_path):
    run("fits", "--smoke", "--validate", "--search", "--out", str(tmp_path))
    result = json.loads((tmp_path / "fits.json").read_text())
    assert {(row["world"], row["method"]) for row in result["validation"]} == {(w, m) for w in (1, 2) for m in MODES}
    assert all(row["measured_mib"] > 0 and len(row["ranks"]) == row["world"] for row in result["validation"])
    assert [row["method"] for row in result["search"]] == [*MODES, "trl_full", "trl_lora"]
    assert all(row["completed"] for row in result["search"])
    # TRL's generations are held at the case's 8 tokens, as ours.
    assert all(row["outcome"]["completion_lengths"] == [8.0, 8.0] for row in result["search"][3:])


@pytest.mark.slow  # 25 s; the core tests hold regenerated projections to the stored ones bit for bit
def test_projections_smoke_run_reports_state_and_times_both_modes(tmp_path):
    run("projections", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "projections.json").read_text())
    step = result["step"]
    assert sorted(step["samples"]) == ["regenerated", "stored"] and len(step["paired_ratios"]) == 2
    # memory_report predicts the allocated state exactly in both modes, and regenerated holds no A.
    assert all(step["allocated_state"][mode]["total"] == step["predicted_state_bytes"][mode] for mode in step["samples"])
    assert step["allocated_state"]["regenerated"]["projections"] == 0 < step["allocated_state"]["stored"]["projections"]
    assert "Smoke run on a tiny model" in (tmp_path / "projections.md").read_text()


def test_smoke_runs_refuse_to_overwrite_the_committed_results():
    completed = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--smoke"], cwd=ROOT, capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode != 0 and "--smoke needs --out" in completed.stderr


# (module, results file, extra arguments): every committed result and the script that renders it.
RENDERED = [
    ("speed", "speed.json", []),
    ("memory", "memory.json", []),
    ("memory_ledger", "memory_ledger.json", []),
    ("phases", "phases.json", []),
    ("kl", "kl.json", []),
    ("quality", "quality.json", []),
    ("core_step", "core_step.json", []),
    ("core_step", "core_step_1thread.json", ["--name", "core_step_1thread"]),
    ("loading", "loading.json", []),
    ("packing", "packing.json", []),
    ("fits", "fits.json", []),
    ("projections", "projections.json", []),
    ("beyond_math", "beyond_math.json", []),
    ("sft_tools", "sft_tools.json", []),
    ("async_rollouts", "async_rollouts.json", []),
    ("step_kl", "step_kl.json", []),
    ("step_kl_rows", "step_kl_rows.json", []),
    ("peers", "peers.json", []),
    ("fit_memory", "fit_memory.json", []),
    ("frontier", "frontier.json", []),
    ("quality_matched_report", "quality_matched.json", []),  # quality_matched's renderer
]


def test_every_committed_result_has_a_renderer():
    assert sorted(path.name for path in RESULTS.glob("*.json")) == sorted(name for _, name, _ in RENDERED)


@pytest.mark.parametrize("module, name", [(module, name) for module, name, _ in RENDERED])
def test_render_reproduces_the_committed_table(module, name):
    """In process: each script's ``render`` of its committed JSON is the committed .md."""
    import importlib

    script = importlib.import_module(f"benchmarks.{module}")
    render = script.markdown if module == "core_step" else script.render
    result = json.loads((RESULTS / name).read_text())
    assert render(result) + "\n" == (RESULTS / name).with_suffix(".md").read_text()


def test_render_option_rewrites_the_table_without_measuring(tmp_path):
    run("speed", "--render", str(RESULTS / "speed.json"), "--out", str(tmp_path))
    assert (tmp_path / "speed.md").read_text() == (RESULTS / "speed.md").read_text()
    assert not (tmp_path / "speed.json").exists()
