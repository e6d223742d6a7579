"""The `logra` command adds our progress bar and model summary when the Trainer's flags leave
them on and the config lists none of their kind; a flag that turns one off is obeyed."""

import pytest
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_logra.callbacks import LoGRAModelSummary, StepProgressBar
from tests.helpers.lightning import in_process_cli

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  enable_checkpointing: false
  default_root_dir: {root}
  strategy: logra_fsdp
  callbacks: {callbacks}
model:
  class_path: tests.helpers.lightning.TinyCausalLM
"""


def callbacks_of(tmp_path, *overrides, listed="[]"):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path, callbacks=listed))
    cli = in_process_cli(config, *overrides)
    return [type(callback) for callback in cli.trainer.callbacks]


def test_the_cli_adds_the_step_bar_and_logras_model_summary(tmp_path):
    added = callbacks_of(tmp_path)
    assert added.count(StepProgressBar) == 1 and added.count(LoGRAModelSummary) == 1


@pytest.mark.parametrize("flag, removed", [("enable_progress_bar", StepProgressBar),
                                           ("enable_model_summary", LoGRAModelSummary)])
def test_a_trainer_flag_that_turns_one_off_is_obeyed(tmp_path, flag, removed):
    added = callbacks_of(tmp_path, f"--trainer.{flag}=false")
    assert removed not in added and len(added) == len(callbacks_of(tmp_path)) - 1


def test_a_listed_progress_bar_is_kept_and_none_added(tmp_path):
    listed = "[{class_path: lightning.pytorch.callbacks.TQDMProgressBar}]"
    added = callbacks_of(tmp_path, listed=listed)
    assert TQDMProgressBar in added and StepProgressBar not in added


def test_the_cli_drops_lightnings_cloud_tip_and_summary_note_only(caplog):
    import logging

    from lightning_logra.notices import LIGHTNING_CONSOLE_NOISE, quiet_lightning_console

    quiet_lightning_console()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name):
        for message in (*LIGHTNING_CONSOLE_NOISE, "GPU available: False, used: False"):
            logger.info(message + " ...")
    assert [record.getMessage() for record in caplog.records] == ["GPU available: False, used: False ..."]
