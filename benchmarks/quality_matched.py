"""RL quality at matched policy change, with intervals: the second protocol of ``quality``.

``quality.py`` compared the methods on one validation set of 24 prompts, chose every best
point on a seed it also reported, and never measured how far a step moved the policy. This
protocol, fixed before measuring (2026-12-02):

1. **Tasks** (``TASKS``): the quickstart's arithmetic, and one reasoning-gym task scored by
   its own ``score_answer`` (``rewards.reasoning_gym.reasoning_gym_reward``), chosen with
   ``--screen``: the untrained SmolLM2-135M-Instruct must start between 10% and 60% on it.
   Chosen: ``syllogism`` with " Answer with just Yes or No." appended (0.328); the others
   screened start at 0% to 10% (the model answers in sentences). Model, batch (4 prompts x
   8 samples, 16 new tokens) and everything else are the quickstart configs'.
2. **Runs**: 24 steps, validation every 6 on ``VAL_SIZE`` = 96 prompts x 4 samples (a
   sample is correct when its reward is 1, full credit), every
   run with ``logging.step_kl`` (``policy/step_kl``) and ``logging.val_completions`` on, so
   each prompt's result is kept. A seed sets everything a run draws: its prompts' order,
   its validation prompts (the same for every method within a seed), its samples, its
   LoRA adapters and LoGRA projections.
3. **Selection** on ``SELECTION_SEED``, which no reported figure uses: dense AdamW's and
   LoRA's learning rate and LoGRA's KL budget are swept (``SWEEPS``); the best point is the
   one with the highest final validation pass@1. A best at the sweep's edge extends it by
   one point in that direction (at most ``MAX_EXTENSIONS``), and the result says so.
4. **Methods** (``METHODS``), each on the reported seeds: ``dense`` (AdamW at its swept
   lr, constant, the quickstart's betas (0.9, 0.95)); ``dense_paper`` (the paper's recipe:
   lr 1e-6, betas (0.9, 0.95), 9 warm-up steps, cosine to 0.1x over 300); ``lora`` (r=256,
   swept lr); ``logra`` (the quickstart's rank, swept budget); ``logra_matched`` (LoGRA with
   its budget set to the median ``policy/step_kl`` of dense's best selection run: the
   KL-matched row). LoGRA's budget is constant in both: the reference's cosine over a long
   run barely moves in its first 24 steps. Ablations, run only when asked
   (``ABLATIONS``): dense without momentum (betas (0, 0.95), dense's selected lr) and the
   KL-matched LoGRA with an 8-response probe (its budget as ``logra_matched``'s); each is
   reported against the row it changes one thing of (``ABLATION_PAIRS``).
5. **Reported** per task: each method's pass@1 gain (final minus the untrained model's, on
   the same prompts) with a 95% two-level bootstrap interval over seeds and prompts
   (``paired_stats``); the paired differences LoGRA - dense and LoGRA (KL-matched) - dense,
   per prompt, with the same interval; steps and seconds to ``THRESHOLD_POINTS`` above the
   untrained pass@1 (median over seeds; a seed that never gets there counts as infinitely
   slow); reward and validation curves against steps and wall-clock with seed bands.
   Targets (``TARGETS``): interval width of the paired differences <= 8 points; at matched
   KL, LoGRA's gain >= 0.95 x dense's or the interval of the difference contains 0; the
   whole protocol <= 3 hours of machine time.

It runs in parts and resumes: every invocation adds the runs it is asked for to
``quality_matched.json`` (``--task``, ``--methods``, ``--seeds``), skips runs already there,
runs a method's selection first when it is missing, and rewrites the .md and .png from
everything measured so far::

    python -m benchmarks.quality_matched --screen letter_counting --instruction " Answer with just the number."
    python -m benchmarks.quality_matched --task arithmetic --methods dense logra --seeds 0   # one part
    python -m benchmarks.quality_matched --task arithmetic                                 # everything of a task
    python -m benchmarks.quality_matched --render benchmarks/results/quality_matched.json
    python -m benchmarks.quality_matched --smoke --out /tmp/qm        # every path on 2-step runs (--task, --methods narrow it)

Run logs and MLflow stores stay in ``lightning_logs/quality_matched/<task>``.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

from .cli_runs import artifact_folder, fresh_work, mlflow_environment, run_logra, timed_metric_history
from .harness import (argument_parser, check_smoke_out, code_version, command_line, load_json, machine_info, save_json,
                      write_outputs)
from .quality_matched_protocol import (ABLATIONS, BASE, CONFIGS, KL_MATCHED, MAX_EXTENSIONS, METHODS, SEEDS,
                                       SELECTION_SEED, STEPS, SWEEPS, TASKS, VAL_EVERY, VAL_SAMPLES, VAL_SIZE,
                                       reasoning_gym_task, selected_value, selection_runs, value_of)
from .quality_matched_report import plot, render

SMOKE = {"steps": 2, "val_every": 1, "val_size": 4, "seeds": (0,), "sweep_points": 1}


def method_overrides(method: str, value: float | None) -> list[str]:
    """The command-line overrides of ``method`` on top of its config, at ``value`` (its
    swept value, or LoGRA's budget)."""
    if method == "dense_paper":
        return ["--model.init_args.optimizer.lr=1e-6", "--model.init_args.optimizer.betas=[0.9,0.95]",
                "--model.init_args.optimizer.warmup_steps=9", "--model.init_args.optimizer.decay_steps=300",
                "--model.init_args.optimizer.min_lr_ratio=0.1"]
    if BASE[method] == "logra":
        logra = "--trainer.strategy.init_args.logra"
        extra = [f"{logra}.probe_responses=8"] if method == "logra_probe8" else []
        return [f"{logra}.kl_budget={value:g}", f"{logra}.kl_budget_final={value:g}", *extra]
    extra = ["--model.init_args.optimizer.betas=[0.0,0.95]"] if method == "dense_no_momentum" else []
    return [f"--model.init_args.optimizer.lr={value:g}", *extra]


def setting(method: str, value: float | None) -> str:
    if method == "dense_paper":
        return "paper recipe"
    return f"{'budget' if BASE[method] == 'logra' else 'lr'}={value:.3g}"


class Runs:
    """Runs ``logra`` for one task into one MLflow store and reads back each run's curves and
    per-prompt validation results."""

    def __init__(self, task: str, steps: int, val_every: int, val_size: int, spec: dict | None = None) -> None:
        self.task, self.steps, self.val_every, self.val_size = task, steps, val_every, val_size
        self.spec = spec or TASKS[task]
        self.work = fresh_work(f"quality_matched/{task}")
        self.environment = mlflow_environment(self.work)

    def common(self, seed: int, name: str) -> list[str]:
        return [f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
                f"--data.init_args.val_size={self.val_size}", "--model.init_args.logging.val_completions=true",
                "--trainer.logger.init_args.experiment_name=quality_matched",
                f"--trainer.logger.init_args.artifact_location={self.work / 'artifacts'}",
                f"--trainer.logger.init_args.run_name={name}", f"--trainer.default_root_dir={self.work}",
                *self.spec["overrides"]]

    def untrained(self, seed: int) -> dict:
        name = f"{self.task}-untrained-seed{seed}"
        print(f"{name}: validating the untrained model on {self.val_size} prompts", flush=True)
        seconds = run_logra(["validate", "-c", CONFIGS["dense"], *self.common(seed, name)], self.environment,
                            self.work / f"{name}.log")
        validations = self.validations(name)
        print(f"  pass@1 {validations[0]['pass_at_1']:.3f} ({seconds:.0f} s)", flush=True)
        return {"task": self.task, "seed": seed, "seconds": seconds, "prompts": validations[0]["prompts"],
                "prompts_digest": validations[0]["prompts_digest"], "correct": validations[0]["correct"],
                "pass_at_1": validations[0]["pass_at_1"]}

    def train(self, method: str, value: float | None, seed: int) -> dict:
        name = f"{self.task}-{method}-{setting(method, value).replace(' ', '_')}-seed{seed}"
        config = CONFIGS[BASE[method]]
        arguments = ["fit", "-c", config, *self.common(seed, name), f"--trainer.max_steps={self.steps}",
                     f"--trainer.val_check_interval={self.val_every}", "--model.init_args.logging.step_kl=true",
                     *method_overrides(method, value)]
        if BASE[method] == "logra":  # its random projections are seeded too
            arguments += [f"--trainer.strategy.init_args.logra.schedule_steps={self.steps}",
                          f"--trainer.strategy.init_args.logra.seed={42 + seed}"]
        print(f"{name}: {self.steps} steps", flush=True)
        seconds = run_logra(arguments, self.environment, self.work / f"{name}.log")
        database = self.work / "mlflow.db"
        validations = self.validations(name)
        for validation in validations:
            del validation["prompts"]  # the untrained record of the seed keeps them; the digest pairs them
        # Lightning logs a validation's metrics at the step before the one it follows; the
        # tables are named after the optimizer steps done, MLflow's clock gives the seconds.
        logged = timed_metric_history(database, name, "val/pass_at_1")
        if len(logged) != len(validations):
            raise SystemExit(f"run {name!r}: {len(logged)} val/pass_at_1 values but {len(validations)} val_completions tables")
        record = {"task": self.task, "method": method, "value": value, "setting": setting(method, value), "seed": seed,
                  "seconds": seconds, "validations": validations,
                  "val_pass_at_1": [(v["step"], v["pass_at_1"], clock) for v, (_, _, clock) in zip(validations, logged)],
                  "reward_mean": timed_metric_history(database, name, "reward/mean"),
                  "step_kl": timed_metric_history(database, name, "policy/step_kl")}
        print(f"  final pass@1 {record['val_pass_at_1'][-1][1]:.3f}, median step KL "
              f"{statistics.median(v for _, v, _ in record['step_kl']):.2e}, {seconds:.0f} s", flush=True)
        return record

    def validations(self, name: str) -> list[dict]:
        """Each validation's per-prompt correct counts, from the run's ``val_completions`` tables."""
        folder = artifact_folder(self.work / "mlflow.db", name) / "val_completions"
        results = []
        for path in sorted(folder.glob("step_*.json")):
            table = json.loads(path.read_text())
            columns = table["columns"]
            prompt, reward = columns.index("prompt"), columns.index("reward")
            rows = table["data"]
            if len(rows) % VAL_SAMPLES:
                raise SystemExit(f"{path}: {len(rows)} samples is not a multiple of {VAL_SAMPLES} per prompt")
            groups = [rows[start:start + VAL_SAMPLES] for start in range(0, len(rows), VAL_SAMPLES)]
            prompts = [group[0][prompt] for group in groups]
            # Full credit only: equal to GRPOModule's rule (any credit) for 0/1 rewards such as
            # the math reward, and strict for a task whose scorer gives partial credit.
            correct = [sum(row[reward] >= 1.0 for row in group) for group in groups]
            results.append({"step": int(path.stem.removeprefix("step_")), "prompts": prompts,
                            "prompts_digest": digest(prompts), "correct": correct,
                            "pass_at_1": sum(correct) / (VAL_SAMPLES * len(correct))})
        if not results:
            raise SystemExit(f"run {name!r} logged no val_completions tables under {folder}")
        return results


def digest(prompts: list[str]) -> str:
    return hashlib.sha256("\n\x00".join(prompts).encode()).hexdigest()[:16]


def has_run(result: dict, task: str, method: str, value, seed: int) -> bool:
    return any(r["task"] == task and r["method"] == method and r["value"] == value and r["seed"] == seed
               for r in result["runs"])


class Protocol:
    """Adds runs to ``result`` (saved after each) until a part's runs are all there."""

    def __init__(self, result: dict, path: Path, runs: Runs, sweep_points: int | None = None) -> None:
        self.result, self.path, self.runs, self.sweep_points = result, path, runs, sweep_points
        self.task = runs.task

    def save(self) -> None:
        save_json(self.path, self.result)

    def untrained(self, seed: int) -> dict:
        found = [u for u in self.result["untrained"] if u["task"] == self.task and u["seed"] == seed]
        if found:
            return found[0]
        record = self.runs.untrained(seed)
        self.result["untrained"].append(record)
        self.save()
        return record

    def run(self, method: str, value, seed: int) -> None:
        if has_run(self.result, self.task, method, value, seed):
            return
        untrained = self.untrained(seed)
        record = self.runs.train(method, value, seed)
        if any(v["prompts_digest"] != untrained["prompts_digest"] for v in record["validations"]):
            raise SystemExit(f"{self.task} seed {seed}: {method} validated on other prompts than the untrained model")
        self.result["runs"].append(record)
        self.save()

    def sweep(self, method: str) -> None:
        values = list(SWEEPS[method])
        if self.sweep_points is not None:  # --smoke: the middle point(s) only
            middle = len(values) // 2
            values = values[middle:middle + self.sweep_points]
        for value in values:
            self.run(method, value, SELECTION_SEED)
        extended = len(selection_runs(self.result, self.task, method)) - len(values)  # by an earlier part
        for _ in range(MAX_EXTENSIONS - extended if self.sweep_points is None else 0):
            ordered = sorted(r["value"] for r in selection_runs(self.result, self.task, method))
            best = selected_value(self.result, self.task, method)
            if best not in (ordered[0], ordered[-1]) or len(ordered) < 2:
                return
            ratio = ordered[1] / ordered[0] if best == ordered[0] else ordered[-1] / ordered[-2]
            extra = float(f"{(best / ratio if best == ordered[0] else best * ratio):.3g}")
            note = f"{self.task}: {method}'s best {setting(method, best)} at the edge of its sweep; extended to {setting(method, extra)}"
            if note not in self.result["notes"]:
                self.result["notes"].append(note)
            print(note, flush=True)
            self.run(method, extra, SELECTION_SEED)

    def part(self, methods: list[str], seeds: list[int]) -> None:
        # The KL-matched rows need dense's selection (its step KL), not LoGRA's.
        swept = {BASE[m] for m in methods if m not in ("dense_paper", *KL_MATCHED)}
        swept |= {"dense"} if set(KL_MATCHED) & set(methods) else set()
        for method in ("dense", "lora", "logra"):
            if method in swept:
                self.sweep(method)
        for seed in seeds:
            for method in methods:
                self.run(method, value_of(self.result, self.task, method), seed)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), help="the task whose runs to add")
    parser.add_argument("--methods", nargs="+", choices=[*METHODS, *ABLATIONS], default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help=f"reported seeds (default {SEEDS})")
    parser.add_argument("--screen", nargs="+", metavar="TASK", help="untrained pass@1 of these reasoning-gym tasks")
    parser.add_argument("--instruction", help="with --screen: appended to every question (default: none)")
    parser.add_argument("--smoke", action="store_true", help="2-step runs on 4 validation prompts: every path, no measurement")
    args = parser.parse_args()
    check_smoke_out(parser, args)

    stem = args.out / "quality_matched"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    if bool(args.screen) == bool(args.task or args.smoke):
        parser.error("give --task (or --smoke, optionally with --task), or --screen")
    path = stem.with_suffix(".json")
    empty = {"untrained": [], "runs": [], "notes": [], "screening": [], "parts": [], "smoke": args.smoke}
    result = load_json(path) if path.exists() else empty
    if result["smoke"] != args.smoke:
        parser.error(f"{path} holds {'smoke' if result['smoke'] else 'measured'} runs; do not mix them with "
                     f"{'smoke' if args.smoke else 'measured'} ones (--out elsewhere)")
    part = {"command": command_line("quality_matched"), "machine": machine_info(), "code": code_version()}
    started = time.perf_counter()
    if args.screen:
        for task in args.screen:
            record = Runs(task, STEPS, VAL_EVERY, VAL_SIZE, reasoning_gym_task(task, args.instruction)).untrained(SELECTION_SEED)
            result["screening"].append({"task": task, "instruction": args.instruction, "pass_at_1": record["pass_at_1"],
                                        "seconds": record["seconds"]})
    else:
        smoke = SMOKE if args.smoke else {}
        tasks = [args.task] if args.task else list(TASKS)
        for task in tasks:
            runs = Runs(task, smoke.get("steps", STEPS), smoke.get("val_every", VAL_EVERY), smoke.get("val_size", VAL_SIZE))
            Protocol(result, path, runs, smoke.get("sweep_points")).part(args.methods, args.seeds or list(smoke.get("seeds", SEEDS)))
    part["runtime_s"] = time.perf_counter() - started
    result["parts"].append(part)
    save_json(path, result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
