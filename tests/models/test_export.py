"""`logra export`: the policy of a training checkpoint becomes a Hugging Face folder whose
model computes the trained policy's logits: a logra_fsdp checkpoint of 1 process (plain
tensors; of 2 processes: tests/integration/test_export_two_ranks.py) and a LoRA run's Lightning
.ckpt (adapters merged)."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.cli import main
from lightning_logra.models import export_checkpoint
from lightning_logra.modules import LoRAConfig, LossConfig, OptimizerConfig
from tests.helpers.grpo import exported_logits, fit_to_checkpoint, grpo_for_export, initial_logits, policy_logits
from tests.helpers.models import byte_tokenizer, tiny_qwen2

# Merging computes W + s * B @ A once in float32 instead of x @ W + s * (x @ A) @ B: the two
# differ by float32 rounding (~1e-7 relative per operation) on logits of size ~1. 1e-5 leaves
# that a wide margin and is far below what the trained adapters change (asserted below).
MERGE_ATOL = 1e-5


@pytest.fixture(scope="module")
def logra_run(tied_folder, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """One logra_fsdp step on 1 process, with a frozen reference copy (kl_coef > 0) in the
    checkpoint beside the policy: the checkpoint folder and the trained policy's logits."""
    module = grpo_for_export(tied_folder, loss=LossConfig(kl_coef=0.1))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-2))
    checkpoint = fit_to_checkpoint(module, tied_folder, tmp_path_factory.mktemp("logra-run"), strategy)
    trained = policy_logits(module.policy)
    assert not torch.equal(trained, initial_logits(tied_folder))  # else equal logits would prove nothing
    return checkpoint, trained


def with_hyper_parameters(checkpoint: Path, destination: Path, **changes) -> Path:
    """A copy of a logra_fsdp checkpoint folder whose recorded hyper-parameters differ (None: absent)."""
    shutil.copytree(checkpoint, destination)
    metadata = torch.load(destination / "meta.pt", weights_only=False)
    for name, value in changes.items():
        if value is None:
            del metadata["hyper_parameters"][name]
        else:
            metadata["hyper_parameters"][name] = value
    torch.save(metadata, destination / "meta.pt")
    return destination


def test_one_process_logra_checkpoint_exports_the_trained_policy_bit_for_bit(logra_run, tmp_path):
    checkpoint, trained = logra_run
    exported = export_checkpoint(checkpoint, tmp_path / "hf")
    assert torch.equal(exported_logits(exported.path), trained)  # the policy, not the reference copy
    assert not exported.lora_merged


def test_exported_folder_holds_config_weights_generation_config_and_tokenizer(logra_run, tied_folder, tmp_path):
    exported = export_checkpoint(logra_run[0], tmp_path / "hf")
    files = {path.name for path in exported.path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    original = AutoTokenizer.from_pretrained(tied_folder)
    assert AutoTokenizer.from_pretrained(exported.path)("1 + 2 = 3").input_ids == original("1 + 2 = 3").input_ids


def test_tied_head_stays_tied_to_the_embedding(logra_run, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(export_checkpoint(logra_run[0], tmp_path / "hf").path)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_lora_checkpoint_exports_a_plain_model_with_the_adapters_merged(tied_folder, tmp_path):
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    module = grpo_for_export(tied_folder, lora=lora, optimizer=OptimizerConfig(lr=5e-2, warmup_steps=0, decay_steps=0))
    checkpoint = fit_to_checkpoint(module, tied_folder, tmp_path / "run", "auto", steps=2)  # the default strategy: a .ckpt file
    trained = policy_logits(module.policy)
    assert (trained - initial_logits(tied_folder)).abs().max() > 100 * MERGE_ATOL
    exported = export_checkpoint(checkpoint, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported.path, dtype=torch.float32)
    assert exported.lora_merged and not any("lora_" in name for name in model.state_dict())
    torch.testing.assert_close(policy_logits(model), trained, atol=MERGE_ATOL, rtol=0)


def test_cli_export_writes_the_folder_and_prints_a_summary(logra_run, tmp_path, capsys):
    main(["export", "--ckpt_path", str(logra_run[0]), "--out", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "config.json").is_file()
    printed = capsys.readouterr().out
    assert f"parameters to {tmp_path / 'hf'} (no LoRA to merge)" in printed


def test_cli_refusal_is_a_one_line_message(tmp_path):
    with pytest.raises(SystemExit, match=f"^logra export: checkpoint {tmp_path / 'missing'} does not exist"):
        main(["export", "--ckpt_path", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")])


def test_cli_help_mentions_export(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["logra"])  # LightningCLI warns when pytest's arguments are there too
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "logra export --ckpt_path PATH --out DIR" in capsys.readouterr().out


def test_model_option_rebuilds_a_checkpoint_whose_model_folder_moved(logra_run, tied_folder, tmp_path):
    moved = with_hyper_parameters(logra_run[0], tmp_path / "moved.ckpt", model=str(tmp_path / "gone"))
    exported = export_checkpoint(moved, tmp_path / "hf", model=tied_folder)
    assert torch.equal(exported_logits(exported.path), logra_run[1])


def test_moved_model_folder_is_refused_naming_the_model_option(logra_run, tmp_path):
    moved = with_hyper_parameters(logra_run[0], tmp_path / "moved.ckpt", model=str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="no longer exists; pass --model"):
        export_checkpoint(moved, tmp_path / "hf")


def test_checkpoint_without_a_model_hyper_parameter_is_refused_without_model_option(logra_run, tmp_path):
    bare = with_hyper_parameters(logra_run[0], tmp_path / "bare.ckpt", model=None)
    with pytest.raises(ValueError, match="records no 'model' hyper-parameter.*pass --model"):
        export_checkpoint(bare, tmp_path / "hf")


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_path_that_is_not_a_checkpoint_is_refused(kind, tmp_path):
    path = tmp_path / "not-a-checkpoint"
    if kind == "folder":
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    else:
        path.write_text("hello")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        export_checkpoint(path, tmp_path / "hf")


def test_a_skeleton_of_other_shapes_is_refused_naming_the_weight(logra_run, tmp_path):
    other = tmp_path / "other-model"
    tiny_qwen2(vocab_size=64).save_pretrained(other)
    byte_tokenizer(tmp_path).save_pretrained(other)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(259, 32\)"):
        export_checkpoint(logra_run[0], tmp_path / "hf", model=str(other))


def test_existing_non_empty_out_is_refused_and_left_alone(logra_run, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(logra_run[0], tmp_path / "hf")
    assert [path.name for path in (tmp_path / "hf").iterdir()] == ["keep.txt"]


def test_overwrite_replaces_only_the_files_export_writes(logra_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (out / "config.json").write_text("{}")
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (out / stale).write_text("weights of another layout")
    export_checkpoint(logra_run[0], out, overwrite=True)
    assert (out / "README.md").read_text() == "mine"  # not the export's: left alone
    assert (out / "config.json").read_text() != "{}"  # the export's: replaced
    assert sorted(path.name for path in out.glob("*.safetensors*")) == ["model.safetensors"]
    assert not (out / "pytorch_model.bin").exists()
    assert torch.equal(exported_logits(out), logra_run[1])
    assert not list(tmp_path.glob(".hf.export-*"))


def test_overwrite_refuses_the_folder_the_run_reads_its_model_from(logra_run, tied_folder, tmp_path):
    before = {path.name: path.stat().st_mtime_ns for path in Path(tied_folder).iterdir()}
    with pytest.raises(ValueError, match="where the run reads its model from"):
        export_checkpoint(logra_run[0], tied_folder, overwrite=True)
    with pytest.raises(ValueError, match="where the run reads its model from"):  # also when --model names another
        export_checkpoint(logra_run[0], Path(tied_folder) / ".", overwrite=True, model=str(tmp_path))
    assert {path.name: path.stat().st_mtime_ns for path in Path(tied_folder).iterdir()} == before


def test_a_symlinked_out_is_refused_before_any_work(logra_run, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(SystemExit, match="symbolic link"):
        main(["export", "--ckpt_path", str(logra_run[0]), "--out", str(tmp_path / "link"), "--overwrite"])
    assert not any((tmp_path / "real").iterdir())


def test_overwrite_refuses_a_folder_that_holds_the_checkpoint(logra_run):
    with pytest.raises(ValueError, match="could damage the checkpoint"):
        export_checkpoint(logra_run[0], logra_run[0].parent, overwrite=True)
