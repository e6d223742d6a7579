"""RL quality as a reward-vs-KL frontier: pass@1 on held-out prompts against the KL of the
policy from its initial weights, per method, over a sweep of each method's step size.

The third quality protocol (the first two, ``quality`` and ``quality_matched``, are kept
as superseded: their validation prompts were in the training pools, and they matched one
step-KL scalar per method). Fixed before measuring, in ``frontier_protocol``:

1. **Tasks**: two-digit sums (``arithmetic:2+``; each seed validates on its own 64 of the
   task's 1,997 validation prompts) and the built-in code task (``code:2``, its 39
   validation prompts, shared by the seeds), both held out by construction; the model, batch
   (4 prompts x 8 samples) and lengths are the quickstart configs'.
2. **Methods and sweeps**: dense AdamW (constant lr), dense at the paper's recipe (warm-up
   9 steps, cosine to 0.1x over 300), LoRA r=256 and LoGRA (constant budget): 4 step sizes
   each, spanning 10x (``SWEEPS``), 5 seeds. A seed sets everything a run draws (prompt
   order, validation prompts, samples, adapters, projections); all methods share it.
3. **Runs**: 12 steps, validation every 4 on the seed's validation prompts x 4 samples
   (full credit counts), logging ``val/kl_from_init`` (KL(policy || initial) per completion
   token over the validation samples, k3-weighted estimate at tokens drawn from the policy:
   ``rl.step_kl``) and each prompt's result; the untrained model is validated once per seed.
4. **Report** (``frontier_report``): pass@1 against KL-from-init, steps and seconds per task
   with seed bands; each method's gain at the fixed KL levels (``LEVELS``) on its frontier;
   paired LoGRA - dense per prompt at each level, with a t-interval over seeds and a
   bootstrap over seeds and prompts (two-level where seeds have their own prompts, crossed
   where they share them). Target: LoGRA's gain >= 0.95 x dense's, or the paired interval
   contains 0 and is at most 8 points wide.
5. **Seconds** come from ``--timing``: every method's step timed alone, one after another
   (nothing else running), so that sweep runs may run two at a time (``--jobs 2``, one
   thread each) without their wall clocks entering the result.
6. **Long runs** (``--long``): each method at its chosen step size (best mean final pass@1
   on ``addition`` over the seeds with all its sweep runs), seed 0, 300 steps, validation
   every 50. Each saves a checkpoint every 7 steps and, stopped and started again with the
   same command, resumes from it into the same MLflow run (hours of runs outlast a working
   session); its seconds add up its launches.
7. **Ablations** (``--ablations``, ``frontier_ablations``): the cheapest changes that could
   close where LoGRA trails, each alone on LoGRA at one budget, compared at equal KL.

It runs in parts and resumes: every invocation adds the runs it is asked for to
``frontier.json``, skipping those already there, saves after each, records its command and
commit, and rewrites the .md and .png from everything measured so far::

    python -m benchmarks.frontier --task addition --seeds 0 --jobs 2   # one part
    python -m benchmarks.frontier --task code                          # everything of a task
    python -m benchmarks.frontier --timing                             # seconds per step, alone
    python -m benchmarks.frontier --long                               # the 300-step runs
    python -m benchmarks.frontier --ablations budget_warmup rank_256 --jobs 2  # LoGRA's ablations
    python -m benchmarks.frontier --render benchmarks/results/frontier.json
    python -m benchmarks.frontier --smoke --out /tmp/frontier          # every path on 2-step runs

Run logs and MLflow stores stay in ``lightning_logs/frontier/<task>/<run>`` (the long runs':
``lightning_logs/frontier/addition-long/<run>``, with their checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cli_runs import (artifact_folder, fresh_work, kept_work, last_logged, mlflow_environment, run_id, run_logra,
                       timed_metric_history)
from .harness import (argument_parser, check_smoke_out, code_version, command_line, load_json, machine_info, save_json,
                      write_outputs)
from .frontier_protocol import (LONG_CHECKPOINT_EVERY, LONG_SEED, LONG_STEPS, LONG_VAL_EVERY, METHODS, SEEDS, STEPS,
                                SWEEPS, TASKS, TIMING_STEPS, VAL_EVERY, VAL_SAMPLES, chosen_value, config_of,
                                method_overrides, setting)
from .frontier_ablations import ABLATIONS, BUDGET as ABLATION_BUDGET, SEEDS as ABLATION_SEEDS, TASK as ABLATION_TASK
from .frontier_report import method_seeds, plot, render
from .quality_matched import digest

SMOKE = {"steps": 2, "val_every": 1, "val_size": 4, "long_steps": 2, "long_val_every": 2, "long_checkpoint_every": 1,
         "timing_steps": 3}


class Runner:
    """Runs ``logra`` for one task, each run in its own folder and MLflow store (so that runs
    may go side by side), and reads back its curves and per-prompt validation results. The
    long runs' folders are kept between invocations: a long run resumes from its checkpoint."""

    def __init__(self, task: str, smoke: dict, threads: int | None, long: bool = False) -> None:
        self.task, self.smoke, self.threads = task, smoke, threads
        self.val_size = smoke.get("val_size", TASKS[task]["val_size"])
        folder = f"frontier{'_smoke' if smoke else ''}/{task}"
        self.root = kept_work(f"{folder}-long") if long else fresh_work(folder)

    def arguments(self, seed: int, name: str, work: Path) -> list[str]:
        return [f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
                f"--data.init_args.val_size={self.val_size}", "--data.init_args.val_batch_size=16",
                "--model.init_args.logging.val_completions=true", "--trainer.logger.init_args.experiment_name=frontier",
                f"--trainer.logger.init_args.artifact_location={work / 'artifacts'}",
                f"--trainer.logger.init_args.run_name={name}", f"--trainer.default_root_dir={work}",
                *TASKS[self.task]["overrides"]]

    def launch(self, command: list[str], name: str, append: bool = False) -> tuple[Path, float]:
        work = self.root / name
        work.mkdir(parents=True, exist_ok=True)
        environment = mlflow_environment(work)
        if self.threads is not None:
            environment["OMP_NUM_THREADS"] = str(self.threads)
        seconds = run_logra(command, environment, work / "run.log", append=append)
        return work, seconds

    def untrained(self, seed: int) -> dict:
        name = f"{self.task}-untrained-seed{seed}"
        shutil.rmtree(self.root / name, ignore_errors=True)  # the long runs' folder is kept: one MLflow run a name
        command = ["validate", "-c", config_of(self.task, "dense"), *self.arguments(seed, name, self.root / name)]
        work, seconds = self.launch(command, name)
        validation = validations(work, name, with_kl=False)[0]
        print(f"{name}: pass@1 {validation['pass_at_1']:.3f} ({seconds:.0f} s)", flush=True)
        return {"task": self.task, "seed": seed, "seconds": seconds, **validation}

    def train(self, method: str, value: float, seed: int, kind: str = "sweep", ablation: str | None = None) -> dict:
        steps, val_every = {"sweep": (self.smoke.get("steps", STEPS), self.smoke.get("val_every", VAL_EVERY)),
                            "long": (self.smoke.get("long_steps", LONG_STEPS), self.smoke.get("long_val_every", LONG_VAL_EVERY)),
                            "timing": (self.smoke.get("timing_steps", TIMING_STEPS), None)}[
                                "sweep" if kind == "ablation" else kind]
        changes = []
        if ablation is not None:  # an ablation is a sweep run with its own overrides (and maybe steps)
            changes = ABLATIONS[ablation].overrides
            steps = self.smoke.get("steps", ABLATIONS[ablation].steps or steps)
            val_every = self.smoke.get("val_every", ABLATIONS[ablation].val_every or val_every)
        name = f"{self.task}-{kind}-{method}-{setting(method, value)}{'-' + ablation if ablation else ''}-seed{seed}"
        command = ["fit", "-c", config_of(self.task, method), *self.arguments(seed, name, self.root / name),
                   f"--trainer.max_steps={steps}", *method_overrides(self.task, method, value)]
        if val_every is None:
            command += ["--trainer.limit_val_batches=0", "--model.init_args.logging.val_completions=false"]
        else:
            command += [f"--trainer.val_check_interval={val_every}", "--model.init_args.logging.kl_from_init=true"]
        if method == "logra":  # its random projections are seeded too; the budget is constant
            command += [f"--trainer.strategy.init_args.logra.schedule_steps={steps}",
                        f"--trainer.strategy.init_args.logra.seed={42 + seed}"]
        command += changes  # last: an ablation's overrides win over the method's and the schedule's
        launches = [time.time()]
        if kind == "long":
            work = self.root / name
            command += checkpointing(work, self.smoke.get("long_checkpoint_every", LONG_CHECKPOINT_EVERY))
            launches = record_launch(work)
            command += resume_arguments(work, name) if len(launches) > 1 else []
        work, seconds = self.launch(command, name, append=len(launches) > 1)
        database = work / "mlflow.db"
        seconds += earlier_launches_seconds(database, name, launches)
        record = {"task": self.task, "kind": kind, "method": method, "value": value, "setting": setting(method, value),
                  **({"ablation": ablation} if ablation else {}), "seed": seed, "steps": steps, "seconds": seconds,
                  "threads": self.threads, "launches": len(launches),
                  "reward_mean": timed_metric_history(database, name, "reward/mean"),
                  "step_kl": timed_metric_history(database, name, "policy/step_kl")}
        if val_every is None:
            clock = [c for _, _, c in record["reward_mean"]]
            record["step_s"] = statistics.median(b - a for a, b in zip(clock[1:], clock[2:]))  # the first step warms up
            print(f"{name}: {record['step_s']:.2f} s per step", flush=True)
            return record
        record["validations"] = validations(work, name, with_kl=True)
        curve = " ".join(f"{v['pass_at_1']:.3f}" for v in record["validations"])
        print(f"{name}: pass@1 {curve}, KL from init "
              f"{record['validations'][-1]['kl_from_init']:.2e} ({seconds:.0f} s)", flush=True)
        return record


def checkpointing(work: Path, every: int) -> list[str]:
    """A long run saves ``last.ckpt`` every ``every`` steps, so that stopping it (the end of
    a working session) loses at most that many steps: started again, it resumes."""
    return ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={work / 'checkpoints'}", f"--trainer.callbacks.every_n_train_steps={every}",
            "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true"]


def record_launch(work: Path) -> list[float]:
    """The wall clocks (epoch seconds) at which the run in ``work`` was launched, this one
    last. A run stopped before its first checkpoint starts over: its folder is emptied."""
    launches_file = work / "launches.json"
    if not (work / "checkpoints" / "last.ckpt").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    # A stop by SIGTERM also saves a checkpoint after its step (``hpc_ckpt_*``), which may be
    # a validation step, whose validation a resume from it would skip: resumes take last.ckpt.
    for stopped in work.glob("hpc_ckpt_*"):
        shutil.rmtree(stopped) if stopped.is_dir() else stopped.unlink()
    launches = json.loads(launches_file.read_text()) if launches_file.exists() else []
    launches.append(time.time())
    launches_file.write_text(json.dumps(launches))
    return launches


def resume_arguments(work: Path, name: str) -> list[str]:
    """From the last checkpoint, into the same MLflow run."""
    return ["--ckpt_path=last", f"--trainer.logger.init_args.run_id={run_id(work / 'mlflow.db', name)}"]


def earlier_launches_seconds(database: Path, name: str, launches: list[float]) -> float:
    """Machine seconds of a resumed run's earlier launches: each from its start to the last
    metric it logged (the steps it ran past its last checkpoint, run again after, count
    twice; the time between that metric and the stop is not known and not counted)."""
    if len(launches) == 1:
        return 0.0
    identifier = run_id(database, name)
    return sum(max(0.0, (last_logged(database, identifier, before=after) or start) - start)
               for start, after in zip(launches, launches[1:]))


def validations(work: Path, name: str, *, with_kl: bool) -> list[dict]:
    """Each validation's prompts (digest), per-prompt correct counts (full credit) and, for a
    fit, ``val/kl_from_init``, from the run's ``val_completions`` tables and MLflow."""
    database = work / "mlflow.db"
    folder = artifact_folder(database, name) / "val_completions"
    results = []
    for path in sorted(folder.glob("step_*.json"), key=lambda p: int(p.stem.removeprefix("step_"))):
        table = json.loads(path.read_text())
        prompt, reward = table["columns"].index("prompt"), table["columns"].index("reward")
        rows = table["data"]
        if len(rows) % VAL_SAMPLES:
            raise SystemExit(f"{path}: {len(rows)} samples is not a multiple of {VAL_SAMPLES} per prompt")
        groups = [rows[start:start + VAL_SAMPLES] for start in range(0, len(rows), VAL_SAMPLES)]
        prompts = [group[0][prompt] for group in groups]
        correct = [sum(row[reward] >= 1.0 for row in group) for group in groups]
        results.append({"step": int(path.stem.removeprefix("step_")), "prompts_digest": digest(prompts),
                        "correct": correct, "pass_at_1": sum(correct) / (VAL_SAMPLES * len(correct))})
    if not results:
        raise SystemExit(f"run {name!r} logged no val_completions tables under {folder}")
    if with_kl:
        logged = timed_metric_history(database, name, "val/kl_from_init")
        if len(logged) != len(results):
            raise SystemExit(f"run {name!r}: {len(logged)} val/kl_from_init values but {len(results)} tables")
        for validation, (_, kl, clock) in zip(results, logged):
            validation["kl_from_init"], validation["clock_s"] = kl, clock
    return results


class Protocol:
    """Adds runs to ``result``, saving after each, up to ``jobs`` at a time."""

    def __init__(self, result: dict, path: Path, jobs: int) -> None:
        self.result, self.path, self.jobs = result, path, jobs
        self.lock = threading.Lock()

    def add(self, key: str, record: dict) -> None:
        with self.lock:
            self.result[key].append(record)
            save_json(self.path, self.result)

    def has(self, task: str, kind: str, method: str, value: float, seed: int, ablation: str | None = None) -> bool:
        return any(r["task"] == task and r["kind"] == kind and r["method"] == method and r["value"] == value
                   and r["seed"] == seed and r.get("ablation") == ablation for r in self.result["runs"])

    def untrained(self, runner: Runner, seeds: list[int]) -> None:
        missing = [s for s in seeds if not any(u["task"] == runner.task and u["seed"] == s for u in self.result["untrained"])]
        self.parallel([lambda seed=seed: self.add("untrained", runner.untrained(seed)) for seed in missing])

    def train(self, runner: Runner, runs: list[tuple], kind: str) -> None:
        """``runs``: (method, value, seed) or, for ablations, (method, value, seed, ablation)."""
        untrained = {u["seed"]: u for u in self.result["untrained"] if u["task"] == runner.task}

        def one(method: str, value: float, seed: int, ablation: str | None = None) -> None:
            record = runner.train(method, value, seed, kind, ablation)
            if any(v["prompts_digest"] != untrained[seed]["prompts_digest"] for v in record.get("validations", [])):
                raise SystemExit(f"{runner.task} seed {seed}: {method} validated on other prompts than the untrained model")
            self.add("runs", record)

        todo = [run for run in runs if not self.has(runner.task, kind, *run)]
        self.parallel([lambda run=run: one(*run) for run in todo])

    def parallel(self, work: list) -> None:
        with ThreadPoolExecutor(self.jobs) as pool:
            for future in [pool.submit(job) for job in work]:
                future.result()  # a failed run stops the part, after the runs under way finish


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), help="the task whose sweep runs to add (default: both)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, help=f"default {list(SEEDS)}; ablations: {list(ABLATION_SEEDS)}")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, one thread each when more than 1")
    parser.add_argument("--timing", action="store_true", help="time every method's step, alone, one after another")
    parser.add_argument("--long", action="store_true", help="the 300-step run of each method at its chosen step size")
    parser.add_argument("--ablations", nargs="+", choices=list(ABLATIONS),
                        help=f"LoGRA's ablations on {ABLATION_TASK}, one after another, each on --seeds (default {list(ABLATION_SEEDS)})")
    parser.add_argument("--smoke", action="store_true", help="2-step runs on 4 validation prompts: every path, no measurement")
    args = parser.parse_args()
    check_smoke_out(parser, args)
    stem = args.out / "frontier"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    if args.timing and args.jobs != 1:
        parser.error("--timing times each step alone: --jobs 1")
    path = stem.with_suffix(".json")
    result = load_json(path) if path.exists() else {"untrained": [], "runs": [], "parts": [], "smoke": args.smoke}
    if result["smoke"] != args.smoke:
        parser.error(f"{path} holds {'smoke' if result['smoke'] else 'measured'} runs; --out elsewhere")
    smoke = SMOKE if args.smoke else {}
    seeds = [LONG_SEED] if args.long else ([0] if args.smoke else args.seeds or list(SEEDS))
    part = {"command": command_line("frontier"), "machine": machine_info(), "code": code_version(),
            "load_before": os.getloadavg()}
    protocol = Protocol(result, path, args.jobs)
    # The part is recorded before its first run, so a part cut off (a machine restart) still
    # names the command and commit of the runs it added; runtime_s stays None then.
    part["runtime_s"] = None
    with protocol.lock:
        result["parts"].append(part)
        save_json(path, result)
    started = time.perf_counter()
    if args.ablations:
        runner = Runner(ABLATION_TASK, smoke, threads=1 if args.jobs > 1 else None)
        seeds = [0] if args.smoke else args.seeds or list(ABLATION_SEEDS)
        protocol.untrained(runner, seeds)
        protocol.train(runner, [("logra", ABLATION_BUDGET, s, a) for a in args.ablations for s in seeds], "ablation")
    tasks = [] if args.ablations else ["addition"] if args.long else [args.task] if args.task else list(TASKS)
    for task in tasks:
        runner = Runner(task, smoke, threads=1 if args.jobs > 1 else None, long=args.long)
        if args.timing:
            protocol.train(runner, [(m, SWEEPS[m][1], 0) for m in args.methods], "timing")
            continue
        protocol.untrained(runner, seeds)
        if args.long:
            # Chosen on the seeds with every sweep run of the method, as the report draws its frontier.
            chosen = {m: SWEEPS[m][1] if args.smoke else
                      chosen_value(result, "addition", m, method_seeds(result, "addition", m)) for m in args.methods}
            if None in chosen.values():
                parser.error(f"--long needs a seed with every sweep run of addition first; missing for "
                             f"{[m for m, v in chosen.items() if v is None]}")
            protocol.train(runner, [(m, chosen[m], LONG_SEED) for m in args.methods], "long")
            continue
        sweep = [(m, v, s) for s in seeds for m in args.methods for v in (SWEEPS[m][1:2] if args.smoke else SWEEPS[m])]
        protocol.train(runner, sweep, "sweep")
    part["runtime_s"], part["load_after"] = time.perf_counter() - started, os.getloadavg()
    save_json(path, result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
