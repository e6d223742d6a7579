import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRAConfig, memory_report


def qwen2_7b_on_meta():
    config = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4,
    )
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def test_report_for_a_7b_config_on_the_meta_device():
    report = memory_report(qwen2_7b_on_meta(), world_size=1)
    # Per layer: rows q 3584 + k 512 + v 512 + o 3584 + gate/up 2 x 18944 + down 3584 = 49,664;
    # widths 6 x 3584 + 18944 = 40,448.
    rows, widths = 28 * 49_664, 28 * 40_448
    assert report.layers == 28 * 7
    assert report.reference_bytes == (rows + widths) * 256 * 4  # the spec's "about 1.4 GB + 1.2 GB"
    assert report.sketch_accumulator_bytes == rows * 256 * 4
    assert report.projection_bytes == widths * 256 * 2  # bf16 storage is exact at rank 256
    assert report.second_moment_bytes == rows * 4
    assert report.dense_adamw_bytes == report.target_parameters * 12
    assert report.logra_state_bytes == report.sketch_accumulator_bytes + report.projection_bytes + report.second_moment_bytes
    assert report.logra_state_bytes < report.reference_bytes < 0.1 * report.dense_adamw_bytes


def test_row_sharding_divides_the_reduced_state_by_the_world_size():
    model = qwen2_7b_on_meta()
    replicated = memory_report(model, world_size=8, sketch_reduction="all_reduce")
    sharded = memory_report(model, world_size=8)
    local = memory_report(model, world_size=8, sketch_accumulation="local")
    rows = 28 * 49_664  # every layer's rows split evenly over 8 ranks
    assert replicated.second_moment_bytes == rows * 4 and sharded.second_moment_bytes == rows // 8 * 4
    assert local.second_moment_bytes == sharded.second_moment_bytes
    # Local accumulation keeps every row; sharded keeps the rank's rows plus two scratch
    # slots for the widest layer (gate/up: 18,944 rows, 2,368 per rank, received + sent).
    assert local.sketch_accumulator_bytes == replicated.sketch_accumulator_bytes == rows * 256 * 4
    assert sharded.sketch_accumulator_bytes == rows // 8 * 256 * 4
    assert sharded.accumulation_scratch_bytes == 2 * 2_368 * (8 + 1) * 256 * 4
    assert local.accumulation_scratch_bytes == replicated.accumulation_scratch_bytes == 0
    assert sharded.logra_state_bytes < local.logra_state_bytes < replicated.logra_state_bytes
    assert sharded.logra_state_bytes <= 0.8 * 2**30  # the target for 7B at world 8 (0.747 GiB)


def test_float32_compute_keeps_float32_projections_and_bad_world_size_is_an_error():
    model = qwen2_7b_on_meta()
    report = memory_report(model, LoGRAConfig(rank=128), compute_dtype=torch.bfloat16)
    assert report.projection_bytes == 28 * 40_448 * 128 * 4  # 1/sqrt(128) is not exact in bf16
    with pytest.raises(ValueError, match="world_size"):
        memory_report(model, world_size=0)
