"""The frontier's long runs resume across launches: which checkpoint a resume takes, what
a stop before the first checkpoint leaves, the seconds of earlier launches, and the value
kept for a step that a resumed run logged twice."""

import json

import mlflow

from benchmarks import frontier
from benchmarks.cli_runs import timed_metric_history
from benchmarks.frontier_protocol import LONG_CHECKPOINT_EVERY, LONG_STEPS, LONG_VAL_EVERY


def test_no_checkpoint_falls_on_a_validation_step():
    # A resume from a checkpoint saved at a validation step would skip that validation.
    checkpoints = range(LONG_CHECKPOINT_EVERY, LONG_STEPS + 1, LONG_CHECKPOINT_EVERY)
    assert all(step % LONG_VAL_EVERY for step in checkpoints) and len(checkpoints) == 42


def test_a_run_stopped_before_its_first_checkpoint_starts_over_and_one_after_it_resumes(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    (work / "run.log").write_text("a launch stopped before step 7")
    assert len(frontier.record_launch(work)) == 1
    assert not (work / "run.log").exists()  # emptied: its MLflow run would share the name

    (work / "checkpoints" / "last.ckpt").mkdir(parents=True)
    (work / "hpc_ckpt_1.ckpt").mkdir()
    (work / "hpc_ckpt_2.ckpt").write_bytes(b"")
    launches = frontier.record_launch(work)
    assert len(launches) == 2 and json.loads((work / "launches.json").read_text()) == launches
    assert (work / "checkpoints" / "last.ckpt").exists() and not list(work.glob("hpc_ckpt_*"))


def log_two_launches(tmp_path):
    """An MLflow run whose first launch logged steps 0-2 and whose resume logged 2-3 again."""
    database = tmp_path / "mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{database}")
    experiment = client.create_experiment("resume", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment, run_name="long")
    first, second = 1_000_000.0, 1_000_500.0
    for step, value, at in [(0, 0.1, first + 40), (1, 0.2, first + 70), (2, 0.3, first + 100),
                            (2, 0.35, second + 50), (3, 0.4, second + 80)]:
        client.log_metric(run.info.run_id, "reward/mean", value, timestamp=int(at * 1000), step=step)
    return database, run.info.run_id, [first, second]


def test_a_step_logged_again_by_the_resume_keeps_its_last_value_and_earlier_launches_count_to_their_last_metric(tmp_path):
    database, run_id, launches = log_two_launches(tmp_path)
    assert [(step, value) for step, value, _ in timed_metric_history(database, "long", "reward/mean")] == [
        (0, 0.1), (1, 0.2), (2, 0.35), (3, 0.4)]
    # The first launch ran 100 s to its last metric; the 400 s it was stopped are not counted.
    assert frontier.earlier_launches_seconds(database, "long", launches) == 100.0
    assert frontier.earlier_launches_seconds(database, "long", launches[:1]) == 0.0
    assert frontier.resume_arguments(tmp_path, "long") == ["--ckpt_path=last",
                                                           f"--trainer.logger.init_args.run_id={run_id}"]
