"""SFT through `logra fit` as users launch it, on 2 gloo processes under logra_fsdp: the
checkpoint written at the end exports (`logra export`) to a Hugging Face folder that
``GRPOModule`` starts from, holding the fine-tuned weights."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_logra.modules import GRPOModule
from tests.helpers.distributed import child_environment, start_logra_fit

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 2
  log_every_n_steps: 1
  enable_progress_bar: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_logra.LoGRAFSDPStrategy
    init_args:
      logra: {{rank: 8, update_ratio: 1.0e-2, kl_budget: 1.0e-2}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/checkpoints, save_top_k: 0, save_last: true}}
  logger: false
model:
  class_path: lightning_logra.modules.SFTModule
  init_args: {{model: {model}, micro_batch_size: 2}}
data:
  class_path: lightning_logra.data.ConversationDataModule
  init_args:
    train: calculator:1
    tokenizer: {model}
    tools: [lightning_logra.tools:calculator]
    batch_size: 2
    train_size: 8
"""


@pytest.mark.distributed
def test_sft_on_two_processes_exports_a_folder_that_rl_starts_from(model_folder, tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(CONFIG.format(root=tmp_path, model=model_folder))
    fit = start_logra_fit(config, tmp_path, OMP_NUM_THREADS="1")
    output = fit.communicate(timeout=420)[0]
    assert fit.returncode == 0, output[-4000:]
    assert "8 train conversations" in output
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()  # a logra_fsdp checkpoint folder, written by both ranks

    out = tmp_path / "model"
    export = [str(Path(sys.executable).parent / "logra"), "export", "--ckpt_path", str(checkpoint), "--out", str(out)]
    exported = subprocess.run(export, cwd=tmp_path, env=child_environment(PYTHONPATH=str(REPO)), capture_output=True,
                              text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]

    tuned = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(model_folder)
    changed = [name for name, value in tuned.state_dict().items() if not torch.equal(value, base.state_dict()[name])]
    assert any(name.endswith("q_proj.weight") for name in changed)  # LoGRA's targets moved
    assert not any("norm" in name for name in changed)  # the rest is frozen under LoGRA
    rl = GRPOModule(model=str(out))
    rl.configure_model()
    assert torch.equal(rl.policy.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                       tuned.state_dict()["model.layers.0.self_attn.q_proj.weight"])
