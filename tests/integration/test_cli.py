"""The `logra` command: configs, overrides, --print_config, and the MLflow run."""

import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from lightning_logra.cli import LoGRACLI, main
from lightning_logra.core.config import DEPRECATED_ALIASES as LOGRA_ALIASES
from lightning_logra.modules.grpo import DEPRECATED_ALIASES as GRPO_ALIASES
from tests.helpers.distributed import child_environment

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 10
  enable_checkpointing: false
  enable_progress_bar: false
  log_every_n_steps: 1
  default_root_dir: {root}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra:
        rank: 8
        update_ratio: 1.0e-3
        kl_budget: 1.0e-4
        kl_budget_final: ${{.kl_budget}}
  callbacks:
    - class_path: lightning_logra.LoGRACallback
  logger:
    class_path: lightning.pytorch.loggers.MLFlowLogger
    init_args:
      experiment_name: cli-test
model:
  class_path: tests.helpers.lightning.TinyCausalLM
  init_args:
    batch_size: 4
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(root=tmp_path))
    return path


def test_logra_fit_runs_and_the_mlflow_run_is_readable(config_file, tmp_path):
    environment = child_environment(PYTHONPATH=str(REPO), MLFLOW_TRACKING_URI="")
    command = [str(Path(sys.executable).parent / "logra"), "fit", "-c", str(config_file), "--trainer.max_steps=2"]
    completed = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["cli-test"], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["trainer/max_steps"] == "2"  # the override, resolved
    assert run.data.params["trainer/strategy/init_args/logra/rank"] == "8"
    assert run.data.params["trainer/strategy/init_args/logra/kl_budget_final"] == "0.0001"  # interpolated
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "logra/alpha")
    assert [m.step for m in history] == [0, 1]
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts


def test_print_config_shows_the_logra_config(config_file, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "-c", str(config_file), "--print_config"])
    printed = capsys.readouterr().out
    assert "class_path: lightning_logra.LoGRAFSDPStrategy" in printed
    for line in ("rank: 8", "beta2: 0.95", "update_factor_dtype: bfloat16", "kl_budget_final: 0.0001"):
        assert line in printed


def test_strategy_name_from_the_command_line(config_file, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "-c", str(config_file), "--trainer.strategy=logra_fsdp", "--print_config"])
    assert "strategy: logra_fsdp" in capsys.readouterr().out


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_shipped_configs_parse(config, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    module = "SFTModule" if config.name.startswith("sft_") else "GRPOModule"
    assert f"class_path: lightning_logra.modules.{module}" in capsys.readouterr().out


OLD_NAMES = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra:
        rank: 8
        refresh: false
        temperature: 0.9
        probe_position_chunk: 32
model:
  class_path: lightning_logra.modules.GRPOModule
  init_args:
    model: {folder}
    logprob_chunk_size: 64
    rollout:
      num_generations: 2
      max_new_tokens: 6
data:
  class_path: lightning_logra.data.PromptDataModule
  init_args:
    train: arithmetic
    tokenizer: {folder}
"""


def test_deprecated_names_in_a_yaml_config_warn_once_each_and_apply(tmp_path, model_folder, no_alias_warned_yet):
    path = tmp_path / "old_names.yaml"
    path.write_text(OLD_NAMES.format(folder=model_folder))
    with pytest.warns(FutureWarning) as caught:
        cli = LoGRACLI(subclass_mode_model=True, subclass_mode_data=True, save_config_callback=None,
                       parser_kwargs={"parser_mode": "omegaconf"}, args=["-c", str(path)], run=False)
    deprecated = sorted(str(w.message).split(":")[0] for w in caught if "is deprecated: use" in str(w.message))
    assert deprecated == [
        "GRPOModule.logprob_chunk_size is deprecated",
        "LoGRAConfig.probe_position_chunk is deprecated",
        "LoGRAConfig.refresh is deprecated",
        "LoGRAConfig.temperature is deprecated",
    ]
    config = cli.trainer.strategy.logra_config
    assert (config.redraw_projections, config.probe_temperature, config.probe_chunk_positions) == (False, 0.9, 32)
    assert cli.model.batching.logprob_chunk_positions == 64


def test_shipped_configs_use_no_deprecated_name():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        strategy = config["trainer"].get("strategy")
        logra = strategy.get("init_args", {}).get("logra") or {} if isinstance(strategy, dict) else {}
        assert not set(logra) & set(LOGRA_ALIASES), path.name
        assert not set(config["model"]["init_args"]) & set(GRPO_ALIASES), path.name


@pytest.mark.parametrize(("args", "documented"), [
    (["--trainer.strategy.help=lightning_logra.LoGRAFSDPStrategy", "--trainer.strategy.logra.help"],
     ["Temperature of the KL probe's softmax", "Deprecated: use ``redraw_projections``"]),
    (["--model.help=lightning_logra.modules.GRPOModule", "--model.loss.help"], ["PPO clip above"]),
])
def test_help_shows_the_config_fields_docstrings(args, documented, capsys):
    with pytest.raises(SystemExit):
        main(["fit", *args])
    printed = " ".join(capsys.readouterr().out.split())  # help text is wrapped
    for text in documented:
        assert text in printed
