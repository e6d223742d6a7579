"""``quality_matched``'s protocol as data: its tasks, sweeps, methods, pairs and targets,
fixed before measuring, and which runs a result reports at which value. Shared by the runner
(``quality_matched``) and its report (``quality_matched_report``), so neither imports the other's
module for them."""

from __future__ import annotations

import json
import statistics

STEPS, VAL_EVERY, VAL_SIZE, VAL_SAMPLES = 24, 6, 96, 4
SELECTION_SEED = 100
SEEDS = (0, 1, 2)
MAX_EXTENSIONS = 1
REWARD = "lightning_logra.rewards.reasoning_gym:reasoning_gym_reward"


def reasoning_gym_task(name: str, instruction: str | None = None, threshold_points: float | None = None) -> dict:
    """A reasoning-gym task as the quickstart's configs run it, scored by its own
    ``score_answer``: its questions as they are, or with ``instruction`` appended."""
    shown = "null" if instruction is None else json.dumps(instruction)
    return {"source": f"reasoning_gym:{name}, scored by its score_answer"
                      + ("" if instruction is None else f", instruction {instruction!r}"),
            "threshold_points": threshold_points, "instruction": instruction,
            "overrides": [f"--data.init_args.train=reasoning_gym:{name}", f"--data.init_args.val=reasoning_gym:{name}",
                          f"--data.init_args.instruction={shown}", f'--model.init_args.reward.functions=["{REWARD}"]']}


# Thresholds fixed before any training run of the task (points of pass@1 above the untrained model).
# syllogism is the first screened task to start inside 10-60% (0.328 with its instruction; see the results).
TASKS = {
    "arithmetic": {"source": "arithmetic:1 (the quickstart's)", "overrides": [], "threshold_points": 25.0},
    "syllogism": reasoning_gym_task("syllogism", instruction=" Answer with just Yes or No.", threshold_points=25.0),
}
CONFIGS = {"dense": "configs/quickstart_dense.yaml", "lora": "configs/quickstart_lora.yaml", "logra": "configs/quickstart.yaml"}
# Swept values in increasing order, around each method's best point in quality.py's sweeps.
SWEEPS = {"dense": (3e-6, 1e-5, 3e-5), "lora": (1e-5, 3e-5, 1e-4), "logra": (2e-3, 5e-3, 1.25e-2)}
METHODS = ("dense", "dense_paper", "lora", "logra", "logra_matched")
ABLATIONS = ("dense_no_momentum", "logra_probe8")
# Which swept method's selected value (or dense's measured step KL) each method runs with.
BASE = {"dense": "dense", "dense_paper": "dense", "lora": "lora", "logra": "logra", "logra_matched": "logra",
        "dense_no_momentum": "dense", "logra_probe8": "logra"}
PAIRS = (("logra", "dense"), ("logra_matched", "dense"))
# Is LoGRA's gap to dense the missing momentum, or its probe's KL prediction?
ABLATION_PAIRS = (("logra_matched", "dense_no_momentum"), ("dense_no_momentum", "dense"),
                  ("logra_probe8", "logra_matched"))
# Methods whose LoGRA budget is dense's measured median step KL rather than a swept value.
KL_MATCHED = ("logra_matched", "logra_probe8")
TARGETS = {"interval_width_points": 8.0, "matched_gain_over_dense": 0.95, "total_hours": 3.0}


# Planning: which runs a part needs, in order ------------------------------------------------
def selection_runs(result: dict, task: str, method: str) -> list[dict]:
    return [r for r in result["runs"] if r["task"] == task and r["method"] == method and r["seed"] == SELECTION_SEED]


def selected_value(result: dict, task: str, method: str) -> float:
    """The best swept value of ``method`` on the selection seed (the smaller on a tie)."""
    runs = sorted(selection_runs(result, task, method), key=lambda r: r["value"])
    return max(runs, key=lambda r: r["val_pass_at_1"][-1][1])["value"]


def matched_budget(result: dict, task: str) -> float:
    """The median ``policy/step_kl`` of dense AdamW's best selection run."""
    best = selected_value(result, task, "dense")
    run = next(r for r in selection_runs(result, task, "dense") if r["value"] == best)
    return float(f"{statistics.median(v for _, v, _ in run['step_kl']):.3g}")


def value_of(result: dict, task: str, method: str) -> float | None:
    if method == "dense_paper":
        return None
    if method in KL_MATCHED:
        return matched_budget(result, task)
    return selected_value(result, task, BASE[method])


def reported(result: dict, task: str, method: str) -> list[dict]:
    """The runs of ``method`` on the reported seeds at its selected value, in seed order."""
    try:
        value = value_of(result, task, method)
    except (ValueError, StopIteration):  # its selection has not run
        return []
    return sorted((r for r in result["runs"] if r["task"] == task and r["method"] == method and r["value"] == value
                   and r["seed"] != SELECTION_SEED), key=lambda r: r["seed"])


def per_prompt_final(run: dict) -> list[float]:
    return [c / VAL_SAMPLES for c in run["validations"][-1]["correct"]]
