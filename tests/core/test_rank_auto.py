"""rank: auto: the largest power of 4 <= min(256, narrowest target input width / 4),
resolved when the sketches are installed; the resolved int is what checkpoints hold."""

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRAConfig, LoGRAOptimizer, install_sketches
from lightning_logra.core.projection import (
    auto_rank,
    projection_is_exact,
    projection_storage_dtype,
    resolve_rank,
)
from tests.helpers.models import tiny_qwen2


@pytest.mark.parametrize(
    ("widths", "rank"),
    [
        ([576, 1536], 64),  # SmolLM2-135M: 576 / 4 = 144 -> 64
        ([896, 4864], 64),  # Qwen2.5-0.5B
        ([1024, 3072], 256),  # hidden 1024 (Qwen3-0.6B-like): the paper's 256
        ([1536, 8960], 256),  # Qwen2.5-1.5B, the paper's smallest model
        ([5120, 27648], 256),  # 27B-class: capped at 256
        ([255], 16),
        ([256], 64),
        ([32, 64], 4),  # the tiny test model
        ([3], 1),
    ],
)
def test_auto_rank_rule(widths, rank):
    assert auto_rank(widths) == rank


def test_auto_rank_is_a_power_of_four_exact_in_bfloat16_and_at_most_a_quarter_of_the_width():
    for width in range(1, 6000, 7):
        rank = auto_rank([width])
        assert projection_is_exact(rank, "rademacher", torch.bfloat16)
        assert rank <= 256 and (rank <= width // 4 or rank == 1)
        assert rank == 256 or 4 * rank > width // 4  # the largest such power of 4


def test_resolve_rank_keeps_integers_and_names_the_field_when_invalid():
    assert resolve_rank(128, [576]) == 128
    assert resolve_rank("auto", [576]) == 64
    with pytest.raises(ValueError, match=r"LoGRAConfig\.rank = 'x' is invalid: must be an integer >= 1 or 'auto'"):
        resolve_rank("x", [576])


def test_invalid_rank_in_the_config_names_the_field():
    with pytest.raises(ValueError, match=r"^LoGRAConfig\.rank = 'x' is invalid: must be an integer >= 1 or 'auto'$"):
        LoGRAConfig(rank="x")
    with pytest.raises(ValueError, match=r"LoGRAConfig\.rank = True is invalid"):
        LoGRAConfig(rank=True)


def test_install_resolves_auto_from_the_targets_without_changing_the_config():
    config = LoGRAConfig(rank="auto")
    sketches = install_sketches(tiny_qwen2(), config)  # hidden 32, intermediate 64: 32 / 4 = 8 -> 4
    assert sketches.rank == 4
    assert all(state.projection.shape == (4, state.module.in_features) for state in sketches)
    assert all(state.sketch.shape == (state.module.out_features, 4) for state in sketches)
    assert config.rank == "auto"


def test_auto_follows_the_targets_that_are_trained():
    config = LoGRAConfig(rank="auto", target_modules=["down_proj"])  # input width 64 -> 16
    assert install_sketches(tiny_qwen2(), config).rank == 16


def test_optimizer_resolves_the_rank_in_its_own_config_and_checkpoint_leaving_the_callers_unchanged():
    config = LoGRAConfig(rank="auto")
    optimizer = LoGRAOptimizer(tiny_qwen2(), config)
    assert config.rank == "auto"
    assert optimizer.config.rank == 4
    saved = json.loads(bytes(optimizer.state_dict()["config"].tolist()).decode())
    assert saved["rank"] == 4


def test_one_auto_config_serves_two_models_of_different_widths():
    config = LoGRAConfig(rank="auto", target_modules=["up_proj"])
    narrow = LoGRAOptimizer(tiny_qwen2(), config)  # inputs 32 wide: 32 / 4 = 8 -> 4
    wide_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2))
    wide = LoGRAOptimizer(wide_model, config)  # inputs 128 wide: 128 / 4 = 32 -> 16
    assert (narrow.config.rank, wide.config.rank) == (4, 16)


@pytest.mark.parametrize("rank", ["auto", 4])
def test_a_checkpoint_of_an_auto_rank_resumes_with_auto_or_the_resolved_int(rank):
    state = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank="auto")).state_dict()
    LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=rank)).load_state_dict(state)


def test_a_checkpoint_of_an_auto_rank_refuses_another_rank():
    state = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank="auto")).state_dict()
    with pytest.raises(ValueError, match="rank: 4 != 16"):
        LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=16)).load_state_dict(state)


def test_an_unresolved_auto_rank_is_a_clear_error_where_an_int_is_needed():
    with pytest.raises(TypeError, match="resolve rank 'auto'"):
        projection_storage_dtype("auto", "rademacher", torch.bfloat16)
