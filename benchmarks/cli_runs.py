"""Helpers of the benchmarks that train through the ``logra`` CLI: their work folder and
MLflow store, running it, and reading MLflow back. (The machine description and plot helpers are in ``harness``.)"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from .harness import ROOT


def fresh_work(name: str) -> Path:
    """``lightning_logs/<name>`` under the repository, emptied: a script's run logs and MLflow
    store, kept after the run for inspection."""
    work = ROOT / "lightning_logs" / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def kept_work(name: str) -> Path:
    """``lightning_logs/<name>``, kept as found: the folder of runs that resume from their
    checkpoints when started again."""
    work = ROOT / "lightning_logs" / name
    work.mkdir(parents=True, exist_ok=True)
    return work


def mlflow_environment(work: Path) -> dict:
    """This process's environment, with MLflow tracking into ``work/mlflow.db``."""
    return dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")


def run_logra(arguments: list[str], environment: dict, log: Path, append: bool = False) -> float:
    """Run ``logra <arguments>`` from the repository root, output to ``log`` (after what it
    holds, with ``append``); seconds taken."""
    started = time.perf_counter()
    with log.open("a" if append else "w") as stream:
        completed = subprocess.run([sys.executable, "-c", "from lightning_logra.cli import main; main()", *arguments],
                                   cwd=ROOT, env=environment, stdout=stream, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise SystemExit(f"`logra {' '.join(arguments)}` failed (exit {completed.returncode}); see {log}")
    return time.perf_counter() - started


def metric_history(database: Path, run_name: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of the MLflow run called ``run_name``, in step order."""
    return [(step, value) for step, value, _ in timed_metric_history(database, run_name, key)]


def timed_metric_history(database: Path, run_name: str, key: str) -> list[tuple[int, float, float]]:
    """(step, value, seconds since the run started) of one metric of the MLflow run called
    ``run_name``, in step order: MLflow stamps every logged value with the wall clock. A run
    resumed from a checkpoint logs the steps after it again: each step's last value is the
    one kept (its seconds then count the time the run was stopped)."""
    with sqlite3.connect(database) as connection:
        rows = connection.execute(
            "select m.step, m.value, (m.timestamp - r.start_time) / 1000.0 from metrics m "
            "join runs r on r.run_uuid = m.run_uuid "
            "join tags t on t.run_uuid = r.run_uuid and t.key = 'mlflow.runName' "
            "where t.value = ? and m.key = ? order by m.step, m.timestamp",
            (run_name, key),
        ).fetchall()
    if not rows:
        raise SystemExit(f"run {run_name!r} logged no {key!r}")
    last = {int(step): (int(step), float(value), float(seconds)) for step, value, seconds in rows}
    return list(last.values())


def run_id(database: Path, run_name: str) -> str:
    """The id of the one MLflow run called ``run_name`` (a resume logs into it again)."""
    return _the_run(database, run_name, "run_uuid")


def last_logged(database: Path, run_id: str, before: float) -> float | None:
    """The wall clock (epoch seconds) of the run's last logged metric before ``before``."""
    with sqlite3.connect(database) as connection:
        (stamp,) = connection.execute("select max(timestamp) from metrics where run_uuid = ? and timestamp < ?",
                                      (run_id, before * 1000.0)).fetchone()
    return None if stamp is None else stamp / 1000.0


def artifact_folder(database: Path, run_name: str) -> Path:
    """The local folder of the artifacts of the MLflow run called ``run_name``."""
    return Path(_the_run(database, run_name, "artifact_uri").removeprefix("file://"))


def _the_run(database: Path, run_name: str, column: str) -> str:
    """``column`` of the one run called ``run_name`` in ``database``'s runs table."""
    with sqlite3.connect(database) as connection:
        rows = connection.execute(f"select r.{column} from runs r join tags t on t.run_uuid = r.run_uuid "
                                  "and t.key = 'mlflow.runName' where t.value = ?", (run_name,)).fetchall()
    if len(rows) != 1:
        raise SystemExit(f"{database}: {len(rows)} runs are called {run_name!r}")
    return rows[0][0]
