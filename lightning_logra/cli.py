"""The ``logra`` command: LightningCLI (fit/validate, YAML configs, OmegaConf
interpolation) with LoGRA's strategy registered, MLflow tracking wired in, our progress bar
and model summary added unless the Trainer's flags turn them off, and
``logra export`` (a checkpoint to a Hugging Face folder), parsed apart from the
LightningCLI, which knows only Trainer methods as subcommands."""

from __future__ import annotations

import argparse
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
from typing_extensions import override

import lightning_logra  # noqa: F401  (registers the "logra_fsdp" strategy name)
from lightning_logra.notices import quiet_lightning_console, quiet_lightning_pytree_notice
from lightning_logra.strategies.atomic import recover_folder
from lightning_logra.strategies.trainer import checkpoint_folders

MLFLOW_LOGGER = "lightning.pytorch.loggers.MLFlowLogger"
EXPORT_HELP = ("logra export --ckpt_path PATH --out DIR: write a checkpoint's policy as a Hugging Face folder "
               "(see logra export --help)")

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


# (Trainer flag, the kind of callback it switches, what the CLI adds when none is listed)
DEFAULT_CALLBACKS = (
    ("enable_progress_bar", ProgressBar, "lightning_logra.callbacks.StepProgressBar"),
    ("enable_model_summary", ModelSummary, "lightning_logra.callbacks.LoGRAModelSummary"),
)


class LoGRACLI(LightningCLI):
    """LightningCLI with MLflow's default store, and our progress bar and model summary
    added when the Trainer's flags leave them on and no config lists one of their kind
    (so ``--trainer.enable_progress_bar=false`` works with every config)."""

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer") or Namespace()
        for logger in _as_list(trainer.get("logger")):
            if _class_path(logger) == MLFLOW_LOGGER:
                init_args = logger["init_args"]
                if not init_args.get("tracking_uri") or str(init_args["tracking_uri"]).startswith("file:"):
                    init_args["tracking_uri"] = default_tracking_uri()
        callbacks = _as_list(trainer.get("callbacks"))
        listed = [_import(_class_path(callback)) for callback in callbacks if _class_path(callback)]
        for flag, kind, class_path in DEFAULT_CALLBACKS:
            if trainer.get(flag) is not False and not any(isinstance(c, type) and issubclass(c, kind) for c in listed):
                callbacks.append(Namespace(class_path=class_path, init_args=Namespace()))
        if callbacks:
            trainer["callbacks"] = callbacks

    @override
    def before_fit(self) -> None:
        """Lightning resolves ``--ckpt_path=last`` and SLURM's ``hpc_ckpt_*`` before the
        strategy's setup, so what a crash left mid-save is put back first (global rank 0;
        processes Lightning launches start after it)."""
        if self.trainer.global_rank == 0:
            for folder in checkpoint_folders(self.trainer):
                recover_folder(folder)


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
    # The config dataclasses document each field in a docstring under it: --help shows them,
    # e.g. logra fit --trainer.strategy.help=LoGRAFSDPStrategy --trainer.strategy.logra.help
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
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
