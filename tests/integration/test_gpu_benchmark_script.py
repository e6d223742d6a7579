"""The GPU benchmark script's smoke mode: every code path of benchmarks/gpu.py on CPU.

Device time is scarce (minutes per session), so the script a GPU session runs must not fail
on a typo. This runs it end to end on a tiny model, as the device machine runs it: ``python -m
benchmarks.gpu`` from the repository root; it measures nothing.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# 2.5 min on 2 cores (ten child processes): `-m slow`. The default run keeps the harness's
# speed and memory smoke runs (tests/integration/test_benchmark_harness.py) for this kind.
@pytest.mark.slow
def test_smoke_run_executes_every_part_and_writes_its_results(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["smoke"] is True and result["not_run"] == []

    fit = [(row["mode"], row["model"], row.get("fits"), row.get("error")) for row in result["fit"]]
    assert fit == [("logra", "Qwen2.5-7B", True, None), ("logra", "Qwen2.5-14B", True, None),
                   ("logra", "27B-class", True, None), ("dense", "Qwen2.5-1.5B", True, None),
                   ("dense", "Qwen2.5-7B", True, None), ("dense", "Qwen2.5-14B", True, None)]
    # The smoke model ties its head as the named config does: Qwen2.5-1.5B ties, 7B does not.
    parameters = {row["model"]: row["parameters"] for row in result["fit"] if row["mode"] == "dense"}
    assert parameters["Qwen2.5-1.5B"] + 512 * 64 == parameters["Qwen2.5-7B"]
    for row in result["fit"]:
        assert set(row["phases_gib"]) == {"build", "rollout", "forward_backward", "update"}
        assert row["step_s"]["step"] > 0 and row["tokens"] == 64

    memory = {row["mode"]: row for row in result["memory_1.5b"]}
    assert sorted(memory) == ["dense", "logra", "lora"]
    # LoRA trains only its adapters; LoGRA trains through sketches, with no gradient at all.
    gradients = {mode: row["breakdown_gib"]["gradients (fp32, as many as trainable parameters)"] for mode, row in memory.items()}
    assert gradients["logra"] == 0 and 0 < gradients["lora"] and 0 < gradients["dense"]
    assert memory["logra"]["breakdown_gib"]["optimizer_or_logra_state"] > 0

    speed = result["speed_1.5b"]
    assert "error" not in speed, speed.get("error")
    assert all(len(speed["samples"][mode]) == 2 for mode in ("dense", "lora", "logra"))
    assert all(len(speed["contention"][mode]) == 2 for mode in ("dense", "lora", "logra"))
    assert speed["medians_s"]["logra"]["kl_probe"] > 0 and speed["medians_s"]["dense"]["kl_probe"] == 0

    assert result["vllm"]["run"] is False and result["vllm"]["reason"]
    assert "Smoke run on a tiny model" in (tmp_path / "gpu.md").read_text()
