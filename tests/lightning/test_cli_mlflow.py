"""The `logra` command's MLflow wiring: an explicit tracking URI is the user's (a `file:`
store included), a missing one becomes a SQLite store in the working folder, created once
under a lock. (Params and multi-process launches: tests/integration/test_cli_launch.py.)"""

from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger

from tests.helpers.lightning import in_process_cli

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  enable_checkpointing: false
  default_root_dir: {root}
  strategy: logra_fsdp
  logger:
    class_path: lightning.pytorch.loggers.MLFlowLogger
    init_args: {{experiment_name: uri-test}}
model:
  class_path: tests.helpers.lightning.TinyCausalLM
"""


def logger_of(tmp_path, monkeypatch, *overrides) -> MLFlowLogger:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path))
    cli = in_process_cli(config, *overrides)
    return cli.trainer.logger


def test_an_explicit_file_tracking_uri_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in itself
    logger = logger_of(tmp_path, monkeypatch, f"--trainer.logger.init_args.tracking_uri=file:{tmp_path}/runs")
    assert logger._tracking_uri == f"file:{tmp_path}/runs"
    logger.experiment  # creates the run in the file store
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "mlflow.db").exists()


def test_no_tracking_uri_becomes_a_sqlite_store_created_under_a_lock(tmp_path, monkeypatch):
    logger = logger_of(tmp_path, monkeypatch)
    assert logger._tracking_uri == f"sqlite:///{Path(tmp_path / 'mlflow.db').absolute()}"
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "mlflow.db.lock").is_file()

