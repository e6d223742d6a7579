"""`logra fit` as users launch it on more than one process: Lightning's own launcher with
`trainer.devices=2`, and two "nodes" of one process each (`num_nodes=2`, NODE_RANK 0/1,
MASTER_ADDR 127.0.0.1, gloo); MLflow on; checkpoint, resume; and resuming into the same
MLflow run."""

import os
import signal
import subprocess
from pathlib import Path

import mlflow
import pytest
import torch

from tests.helpers.distributed import start_logra_fit, free_port

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  log_every_n_steps: 1
  enable_progress_bar: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra: {{rank: 8, update_ratio: 1.0e-3, kl_budget: 1.0e-3}}
  callbacks:
    - class_path: lightning_logra.LoGRACallback
      init_args: {{log_memory: false}}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/ckpt, every_n_train_steps: 1, save_top_k: -1, save_last: true}}
  logger:
    class_path: lightning.pytorch.loggers.MLFlowLogger
    init_args: {{experiment_name: launch, tracking_uri: "sqlite:///{root}/mlflow.db"}}
model:
  class_path: tests.helpers.grpo.RecordingGRPO
  init_args:
    model: {model}
    reward: {{functions: [tests.helpers.grpo:varied_reward]}}
    batching: {{micro_batch_size: 2}}
    record_to: {root}/final.pt
    loss: {{type: reinforce_baseline}}
    rollout: {{num_generations: 2, max_new_tokens: 5}}
    optimizer: {{lr: 1.0e-3, warmup_steps: 0, decay_steps: 0}}
data:
  class_path: lightning_logra.data.PromptDataModule
  init_args: {{train: arithmetic, tokenizer: {model}, batch_size: 2, train_size: 16}}
"""


@pytest.fixture
def launched():
    """The `logra fit` processes a test starts; killed with their children if a test fails
    while they run (a rank whose partner died would wait in a collective for good)."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def launch(launched: list, root: Path, model: str, *overrides: str, **environment: str) -> subprocess.Popen:
    config = root / "launch.yaml"  # not config.yaml: the run saves its resolved config there
    if not config.exists():  # written once: two "nodes" share the folder
        root.mkdir()
        config.write_text(CONFIG.format(root=root, model=model))
    # One thread per process everywhere: Lightning gives a process cores / local processes
    # threads, so a 2-node run (1 local process) would round its reductions differently.
    process = start_logra_fit(config, root, *overrides, OMP_NUM_THREADS="1", **environment)
    launched.append(process)
    return process


def finish(process: subprocess.Popen, what: str) -> str:
    output = process.communicate(timeout=420)[0]
    assert process.returncode == 0, f"{what} failed:\n{output[-4000:]}"
    return output


def mlflow_runs(root: Path) -> list:
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["launch"], output_format="list")


@pytest.mark.distributed
def test_two_processes_and_two_nodes_through_logra_fit_resume_to_the_uninterrupted_weights(model_folder, tmp_path, launched):
    whole = launch(launched, tmp_path / "whole", model_folder, "--trainer.devices=2")
    finish(whole, "logra fit --trainer.devices=2")
    assert (tmp_path / "whole" / "ckpt" / "last.ckpt").is_dir()

    # Two "nodes" of one process each, through Lightning's own launcher: stop after 2 steps.
    port = str(free_port())
    nodes = [launch(launched, tmp_path / "split", model_folder, "--trainer.num_nodes=2", "--trainer.max_steps=2",
                    NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for node in (0, 1)]
    for node, process in enumerate(nodes):
        finish(process, f"node {node} of logra fit --trainer.num_nodes=2")
    assert (tmp_path / "split" / "ckpt" / "epoch=0-step=2.ckpt").is_dir()

    # ... and resume on one node with 2 devices.
    finish(launch(launched, tmp_path / "split", model_folder, "--trainer.devices=2", "--ckpt_path=last"), "the resume")

    uninterrupted = torch.load(tmp_path / "whole" / "final.pt", weights_only=False)
    resumed = torch.load(tmp_path / "split" / "final.pt", weights_only=False)
    assert uninterrupted["weights"].keys() == resumed["weights"].keys()
    for name, value in uninterrupted["weights"].items():
        assert torch.equal(value, resumed["weights"][name]), name
    assert resumed["baseline"] == uninterrupted["baseline"]
    for step in (3, 4):
        assert resumed["history"][step] == uninterrupted["history"][step], step

    run = mlflow_runs(tmp_path / "whole")[0]  # rank 0 logged the config and every step
    assert run.data.params["trainer/devices"] == "2"
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "logra/alpha")
    assert [m.step for m in history] == [0, 1, 2, 3]


@pytest.mark.slow  # 37 s: two more launches; the two-process test above resumes through logra fit in the default run
def test_resuming_into_the_same_mlflow_run_logs_the_launch_nowhere_and_warns_on_changed_settings(model_folder, tmp_path, launched):
    root = tmp_path / "run"
    finish(launch(launched, root, model_folder, "--trainer.max_steps=2"), "the first run")
    (run,) = mlflow_runs(root)
    assert not {"ckpt_path", "config", "print_config"} & set(run.data.params)

    # max_steps back to the config's 4: the one setting this resume changes
    resumed = launch(launched, root, model_folder, "--ckpt_path=last", f"--trainer.logger.init_args.run_id={run.info.run_id}")
    output = finish(resumed, "the resume into the same MLflow run")
    assert "trainer/max_steps: 2 -> 4" in output
    (again,) = mlflow_runs(root)
    assert again.info.run_id == run.info.run_id
    assert again.data.params["trainer/max_steps"] == "2"  # MLflow keeps the first value
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "logra/alpha")
    assert [m.step for m in history] == [0, 1, 2, 3]
