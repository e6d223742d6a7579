import re

import pytest
import yaml
from jsonargparse import ArgumentParser
from omegaconf import OmegaConf

from lightning_logra import LoGRAConfig
from lightning_logra.core.config import DEFAULT_TARGET_MODULES, STRUCTURAL_FIELDS


def test_defaults_match_the_paper():
    config = LoGRAConfig()
    assert (config.rank, config.seed, config.distribution, config.refresh) == (256, 42, "rademacher", True)
    assert config.update_factor_dtype == "bfloat16"
    assert (config.beta2, config.epsilon, config.update_ratio) == (0.95, 1e-8, 6e-5)
    assert (config.kl_budget, config.kl_budget_final, config.schedule_steps) == (2e-4, 2e-5, 300)
    assert (config.alpha_max, config.probe_responses, config.probe_max_tokens) == (3.0, 2, 4096)
    assert (config.mismatch_subtraction, config.mismatch_ema_weight, config.mismatch_budget_floor) == (True, 0.3, 0.5)
    assert config.target_modules == list(DEFAULT_TARGET_MODULES) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("rank", 0, ">= 1"),
        ("rank", "x", "must be an integer >= 1 or 'auto'"),
        ("share_projection_by_input", "yes", "true or false"),
        ("beta2", 1.0, "(0, 1)"),
        ("epsilon", -1.0, "> 0"),
        ("update_ratio", float("nan"), "> 0"),
        ("distribution", "uniform", "'rademacher'"),
        ("alpha_max", 0.5, ">= 1"),
        ("target_modules", [], "non-empty"),
        ("target_modules", ["model.q_proj"], "last name component"),
        ("mismatch_budget_floor", 1.5, "(0, 1]"),
        ("sketch_reduction", "ring", "'reduce_scatter'"),
        ("sketch_accumulation", "eager", "'sharded'"),
    ],
)
def test_invalid_value_names_the_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.{field} = .*{re.escape(allowed)}"):
        LoGRAConfig(**{field: value})


def test_sharded_accumulation_needs_the_reduce_scatter_layout():
    with pytest.raises(ValueError, match=r"LoGRAConfig\.sketch_accumulation = 'sharded'.*sketch_reduction='all_reduce'"):
        LoGRAConfig(sketch_accumulation="sharded", sketch_reduction="all_reduce")
    assert LoGRAConfig(sketch_accumulation="auto", sketch_reduction="all_reduce").sketch_accumulation == "auto"


def test_round_trips_through_omegaconf_and_yaml():
    config = LoGRAConfig(rank=64, target_modules=["q_proj", "v_proj"], kl_budget=1e-3)
    structured = OmegaConf.structured(config)
    text = OmegaConf.to_yaml(structured)
    back = LoGRAConfig.from_dict(OmegaConf.to_container(OmegaConf.create(text)))
    assert back == config
    assert LoGRAConfig.from_dict(yaml.safe_load(text)) == config


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field.*rnak"):
        LoGRAConfig.from_dict({"rnak": 3})


def test_usable_as_jsonargparse_argument_type():
    parser = ArgumentParser()
    parser.add_argument("--logra", type=LoGRAConfig, default=LoGRAConfig())
    parsed = parser.parse_args(["--logra.rank=128", "--logra.target_modules=[q_proj,k_proj]"])
    config = parser.instantiate_classes(parsed).logra
    assert isinstance(config, LoGRAConfig)
    assert config.rank == 128 and config.target_modules == ["q_proj", "k_proj"]
    with pytest.raises(ValueError, match=r"LoGRAConfig\.rank = 0"):
        parser.instantiate_classes(parser.parse_args(["--logra.rank=0"]))


def test_new_options_default_to_the_reference():
    config = LoGRAConfig()
    assert config.rank == 256 and config.share_projection_by_input is False


def test_sharing_and_rank_are_structural():
    assert {"rank", "share_projection_by_input"} <= set(STRUCTURAL_FIELDS)
    saved = LoGRAConfig().to_dict()
    assert LoGRAConfig(share_projection_by_input=True).structural_mismatches(saved) == [
        "share_projection_by_input: False != True"
    ]


def test_a_structural_field_missing_from_an_older_checkpoint_counts_as_its_default():
    saved = LoGRAConfig().to_dict()
    del saved["share_projection_by_input"]
    assert LoGRAConfig().structural_mismatches(saved) == []
    assert LoGRAConfig(share_projection_by_input=True).structural_mismatches(saved) == [
        "share_projection_by_input: False != True"
    ]


def test_rank_auto_and_sharing_parse_from_the_command_line_and_yaml():
    parser = ArgumentParser()
    parser.add_argument("--logra", type=LoGRAConfig, default=LoGRAConfig())
    parsed = parser.parse_args(["--logra.rank=auto", "--logra.share_projection_by_input=true"])
    config = parser.instantiate_classes(parsed).logra
    assert config.rank == "auto" and config.share_projection_by_input is True
    assert parser.instantiate_classes(parser.parse_args(["--logra.rank=64"])).logra.rank == 64
    text = OmegaConf.to_yaml(OmegaConf.structured(LoGRAConfig(rank="auto", share_projection_by_input=True)))
    assert LoGRAConfig.from_dict(yaml.safe_load(text)) == LoGRAConfig(rank="auto", share_projection_by_input=True)
