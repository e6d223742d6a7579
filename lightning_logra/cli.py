"""The ``logra`` command: LightningCLI (fit/validate, YAML configs, OmegaConf
interpolation) with LoGRA's strategy registered and MLflow tracking wired in."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import lightning_logra  # noqa: F401  (registers the "logra_fsdp" strategy name)

MLFLOW_LOGGER = "lightning.pytorch.loggers.MLFlowLogger"

def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else an embedded SQLite store in the working folder
    (MLflow 3 refuses its old file store unless told otherwise)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').absolute()}"


class MLflowConfigCallback(SaveConfigCallback):
    """Saves the resolved config into the run's log folder (or the Trainer's root folder
    when the logger has none, as MLflow with a database store), and into every MLflow run:
    flattened as params, and the YAML file as an artifact."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "save_to_log_dir": False})

    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / self.config_filename).write_text(text)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.log_hyperparams(self.config.as_dict())
                with tempfile.TemporaryDirectory() as scratch:
                    path = Path(scratch) / self.config_filename
                    path.write_text(text)
                    logger.experiment.log_artifact(logger.run_id, str(path))


class LoGRACLI(LightningCLI):
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for logger in _as_list(config.get("trainer", {}).get("logger")):
            if _class_path(logger) == MLFLOW_LOGGER:
                init_args = logger["init_args"]
                if not init_args.get("tracking_uri") or str(init_args["tracking_uri"]).startswith("file:"):
                    init_args["tracking_uri"] = default_tracking_uri()


def _as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def _class_path(value: Any) -> str | None:
    try:
        return value["class_path"]
    except (KeyError, TypeError):
        return None


def main(args: list[str] | None = None) -> None:
    LoGRACLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=MLflowConfigCallback,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf"},
        args=args,
    )


if __name__ == "__main__":
    main()
