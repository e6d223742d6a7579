"""The ``logra`` command: LightningCLI (fit/validate, YAML configs, OmegaConf
interpolation) with LoGRA's strategy registered, MLflow tracking wired in, our progress bar
and model summary added unless the Trainer's flags turn them off, a checkpoint on
preemption, and ``logra export`` (a checkpoint to a Hugging Face folder), parsed apart
from the LightningCLI, which knows only Trainer methods as subcommands."""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from jsonargparse import set_parsing_settings
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

import lightning_logra  # noqa: F401  (registers the "logra_fsdp" strategy name)
from lightning_logra.callbacks import PreemptionCheckpoint
from lightning_logra.allocator import restart_with_tuned_malloc, tune_glibc_malloc
from lightning_logra.notices import quiet_lightning_console, quiet_lightning_pytree_notice
from lightning_logra.strategies.trainer import claim_checkpoint_folders

MLFLOW_LOGGER = "lightning.pytorch.loggers.MLFlowLogger"
EXPORT_HELP = ("logra export --ckpt_path PATH --out DIR: write a checkpoint's policy as a Hugging Face folder "
               "(see logra export --help)")

def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else an embedded SQLite store in the working folder
    (MLflow 3 refuses its old file store unless told otherwise)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').absolute()}"


def create_sqlite_store(tracking_uri: str) -> None:
    """Create an MLflow SQLite store (its schema) once, under a file lock beside it: every
    process of a multi-node launch builds the logger, and two processes creating the schema
    at once fail ("duplicate column name"). Other stores are left to MLflow."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    from mlflow import MlflowClient  # on use: --help stays light

    database = Path(tracking_uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        MlflowClient(tracking_uri).search_experiments(max_results=1)


class MLflowConfigCallback(SaveConfigCallback):
    """Saves the resolved config into the run's log folder (or the Trainer's root folder
    when the logger has none, as MLflow with a database store), and into every MLflow run:
    flattened as params, and the YAML file as an artifact.

    Params describe the run, not how it was launched: ``ckpt_path``, the config files'
    paths and ``--print_config`` are left out, so resuming into the same MLflow run
    (``run_id``) logs nothing new. MLflow keeps a param's first value: a resume that
    changes one (e.g. ``trainer.max_steps``) warns, naming each, and the artifact holds
    the latest YAML."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "save_to_log_dir": False})
        self._folder: Path | None = None

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:  # the same on every rank: Lightning broadcasts it after each save
            # trainer.log_dir is a broadcast that every rank must join, while Lightning calls
            # save_config on rank 0 only: read it here, on every rank, or the ranks hang.
            self._folder = Path(trainer.log_dir or trainer.default_root_dir)
        super().setup(trainer, pl_module, stage)

    @override
    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        assert self._folder is not None, "setup reads the log folder before Lightning calls save_config"
        self._folder.mkdir(parents=True, exist_ok=True)
        (self._folder / self.config_filename).write_text(text)
        params = _flat_params({key: value for key, value in self.config.as_dict().items() if key not in LAUNCH_KEYS})
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.log_hyperparams(_new_params(logger, params))
                with tempfile.TemporaryDirectory() as scratch:
                    path = Path(scratch) / self.config_filename
                    path.write_text(text)
                    logger.experiment.log_artifact(logger.run_id, str(path))


# How a run was launched (the subcommand's own arguments), not what it is.
LAUNCH_KEYS = frozenset({"config", "ckpt_path", "print_config"})
MLFLOW_PARAM_CHARS = 250  # what Lightning's MLFlowLogger keeps of a value


def _flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer/max_steps": "2", ...}``: nested dicts flattened with "/" and values as
    the strings MLflow stores, as Lightning's MLFlowLogger writes them."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_params(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = str(value)[:MLFLOW_PARAM_CHARS]
    return flat


def _new_params(logger: MLFlowLogger, params: dict[str, str]) -> dict[str, str]:
    """The params the MLflow run does not hold yet; those it holds with another value
    (a resume with changed settings) are reported, as MLflow refuses to change them."""
    logged = logger.experiment.get_run(logger.run_id).data.params
    changed = [f"{key}: {logged[key]} -> {value}" for key, value in params.items()
               if key in logged and logged[key] != value]
    if changed:
        rank_zero_warn(f"MLflow run {logger.run_id} keeps the first value of each param; this run changed "
                       f"{len(changed)}: " + "; ".join(changed) + "; the config artifact holds the new values")
    return {key: value for key, value in params.items() if key not in logged}


# (Trainer flag or None for always, the kind of callback, what the CLI adds when none is listed)
DEFAULT_CALLBACKS = (
    ("enable_progress_bar", ProgressBar, "lightning_logra.callbacks.StepProgressBar"),
    ("enable_model_summary", ModelSummary, "lightning_logra.callbacks.LoGRAModelSummary"),
    (None, PreemptionCheckpoint, "lightning_logra.callbacks.PreemptionCheckpoint"),
)


class LoGRACLI(LightningCLI):
    """LightningCLI with MLflow's default store, and our progress bar and model summary
    added when the Trainer's flags leave them on and no config lists one of their kind
    (so ``--trainer.enable_progress_bar=false`` works with every config), and a
    PreemptionCheckpoint unless one is listed."""

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer") or Namespace()
        for logger in _as_list(trainer.get("logger")):
            if _class_path(logger) == MLFLOW_LOGGER:
                init_args = logger["init_args"]
                if not init_args.get("tracking_uri"):  # an explicit one, file: included, is the user's choice
                    init_args["tracking_uri"] = default_tracking_uri()
                create_sqlite_store(str(init_args["tracking_uri"]))
        callbacks = _as_list(trainer.get("callbacks"))
        listed = [_import(_class_path(callback)) for callback in callbacks if _class_path(callback)]
        for flag, kind, class_path in DEFAULT_CALLBACKS:
            wanted = flag is None or trainer.get(flag) is not False
            if wanted and not any(isinstance(c, type) and issubclass(c, kind) for c in listed):
                callbacks.append(Namespace(class_path=class_path, init_args=Namespace()))
        if callbacks:
            trainer["callbacks"] = callbacks

    @override
    def before_fit(self) -> None:
        """Lightning resolves ``--ckpt_path=last`` and ``hpc`` before the strategy's setup, so
        the run's checkpoint folders are locked and what a crash left mid-save is put back
        first (global rank 0; processes Lightning launches start after it)."""
        claim_checkpoint_folders(self.trainer)


def _as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def _class_path(value: Any) -> str | None:
    try:
        return value["class_path"]
    except (KeyError, TypeError):
        return None


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name, None)


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logra export",
        description="Write the policy of a training checkpoint as a Hugging Face folder (LoRA adapters merged).",
    )
    parser.add_argument("--ckpt_path", required=True, help="a logra_fsdp checkpoint folder or a Lightning .ckpt file")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--model", default=None,
                        help="hub id or folder to build the model from, instead of the one the checkpoint records")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    return parser


def export(args: list[str]) -> None:
    """``logra export``: refusals of the user's inputs end with their message, not a traceback."""
    from lightning_logra.models.export import export_checkpoint  # on use: fit and --help stay light

    options = export_parser().parse_args(args)
    try:
        exported = export_checkpoint(options.ckpt_path, options.out, model=options.model, overwrite=options.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        raise SystemExit(f"logra export: {error}") from error
    print(exported.summary())


def main(args: list[str] | None = None) -> None:
    given = sys.argv[1:] if args is None else list(args)
    if given[:1] == ["export"]:
        export(given[1:])
        return
    if args is None:  # a command, not a call from Python: its process is ours to restart
        # glibc's small-block cache off from the start (allocator.py). `logra` has restarted
        # already, before importing the library (lightning_logra_command); here only
        # `python -m lightning_logra.cli`, which pays the library's import twice.
        restart_with_tuned_malloc()
    # The config dataclasses document each field in a docstring under it: --help shows them,
    # e.g. logra fit --trainer.strategy.help=LoGRAFSDPStrategy --trainer.strategy.logra.help
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    tune_glibc_malloc()  # before any tensor: every rank's RSS follows its live memory (allocator.py)
    quiet_lightning_pytree_notice()  # dense and LoRA runs too, whose strategy is Lightning's
    quiet_lightning_console()
    LoGRACLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=MLflowConfigCallback,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"parser_mode": "omegaconf", "epilog": EXPORT_HELP},
        args=args,
    )


if __name__ == "__main__":
    main()
