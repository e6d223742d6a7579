import dataclasses
import inspect
import re
import threading
import warnings

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from omegaconf import OmegaConf

from lightning_logra import LoGRAConfig
from lightning_logra.core.config import DEFAULT_TARGET_MODULES, DEPRECATED_ALIASES, STRUCTURAL_FIELDS, saved_config
from lightning_logra.core.validation import MAX_SEED, MAX_TIMEOUT_S


def test_defaults_match_the_paper():
    config = LoGRAConfig()
    assert (config.rank, config.seed, config.distribution, config.redraw_projections) == (256, 42, "rademacher", True)
    assert config.update_factor_dtype == "bfloat16"
    assert (config.beta2, config.epsilon, config.update_ratio) == (0.95, 1e-8, 6e-5)
    assert (config.kl_budget, config.kl_budget_final, config.schedule_steps) == (2e-4, 2e-5, 300)
    assert (config.alpha_max, config.probe_max_tokens) == (3.0, 4096)
    # The authors probe their first 2 responses; ours by default one from each of 8 strata (issue 41).
    assert (LoGRAConfig(kl_probe="reference").probe_rows(), config.kl_probe, config.probe_rows()) == (2, "weighted", 8)
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


# Renamed fields ------------------------------------------------------------------------------
OLD_NAME_VALUES = {"temperature": 0.7, "refresh": False, "row_chunk": 64, "probe_position_chunk": 32,
                   "probe_mlp_chunk": 16}


def test_the_alias_table_names_every_deprecated_keyword_and_a_field_for_each():
    fields = {f.name for f in dataclasses.fields(LoGRAConfig)}
    keywords_only = set(inspect.signature(LoGRAConfig).parameters) - fields
    assert keywords_only == set(DEPRECATED_ALIASES) == set(OLD_NAME_VALUES)
    assert set(DEPRECATED_ALIASES.values()) <= fields
    assert DEPRECATED_ALIASES == {"temperature": "probe_temperature", "refresh": "redraw_projections",
                                  "row_chunk": "update_chunk_rows", "probe_position_chunk": "probe_chunk_positions",
                                  "probe_mlp_chunk": "probe_mlp_chunk_tokens"}


@pytest.mark.parametrize("old", sorted(OLD_NAME_VALUES))
def test_a_deprecated_name_sets_its_new_field_and_warns(old, no_alias_warned_yet):
    new = DEPRECATED_ALIASES[old]
    with pytest.warns(FutureWarning, match=rf"LoGRAConfig\.{old} is deprecated: use {new}"):
        config = LoGRAConfig(**{old: OLD_NAME_VALUES[old]})
    assert getattr(config, new) == OLD_NAME_VALUES[old]
    assert config == LoGRAConfig(**{new: OLD_NAME_VALUES[old]})
    assert old not in config.to_dict() and f" {old}=" not in repr(config)


@pytest.mark.parametrize("old", sorted(OLD_NAME_VALUES))
def test_a_deprecated_name_reads_and_writes_its_new_field_as_an_attribute(old, no_alias_warned_yet):
    new, config = DEPRECATED_ALIASES[old], LoGRAConfig()
    with pytest.warns(FutureWarning, match=rf"LoGRAConfig\.{old} is deprecated: use {new}"):
        assert getattr(config, old) == getattr(config, new)
    setattr(config, old, OLD_NAME_VALUES[old])
    assert getattr(config, new) == OLD_NAME_VALUES[old]


def test_replace_neither_warns_nor_mistakes_a_field_for_its_deprecated_name(no_alias_warned_yet):
    config = LoGRAConfig(probe_temperature=0.5, redraw_projections=False, update_chunk_rows=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replaced = dataclasses.replace(config, seed=1)
    assert replaced == LoGRAConfig(seed=1, probe_temperature=0.5, redraw_projections=False, update_chunk_rows=64)


def test_a_deprecated_name_warns_once_per_process(no_alias_warned_yet):
    with pytest.warns(FutureWarning) as first:
        LoGRAConfig(refresh=False, row_chunk=64)
    assert len(first) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoGRAConfig(refresh=False, row_chunk=32)


def test_a_deprecated_name_and_its_new_name_together_raise(no_alias_warned_yet):
    with pytest.raises(ValueError, match=r"LoGRAConfig\.refresh = False and LoGRAConfig\.redraw_projections = "
                                         r"False are both given.*give redraw_projections only"):
        LoGRAConfig(refresh=False, redraw_projections=False)


def test_a_value_given_under_a_deprecated_name_is_validated(no_alias_warned_yet):
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"LoGRAConfig\.update_chunk_rows = 0"):
        LoGRAConfig(row_chunk=0)


def test_from_dict_reads_deprecated_names(no_alias_warned_yet):
    with pytest.warns(FutureWarning, match="LoGRAConfig.probe_mlp_chunk is deprecated"):
        assert LoGRAConfig.from_dict({"probe_mlp_chunk": 16}).probe_mlp_chunk_tokens == 16


def test_a_saved_configuration_under_old_names_is_read_under_the_new_ones_silently():
    old_name = {new: old for old, new in DEPRECATED_ALIASES.items()}
    saved = {old_name.get(name, name): value for name, value in LoGRAConfig().to_dict().items()}
    assert set(DEPRECATED_ALIASES) <= set(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert saved_config(saved) == LoGRAConfig().to_dict()
        assert LoGRAConfig().structural_mismatches(saved) == []
        assert LoGRAConfig().tuning_changes(saved) == []
    assert LoGRAConfig(redraw_projections=False).structural_mismatches({**saved, "refresh": True}) == [
        "redraw_projections: True != False"
    ]
    assert LoGRAConfig(update_chunk_rows=64).tuning_changes(saved) == ["update_chunk_rows: 256 -> 64"]
    with pytest.raises(ValueError, match="both 'refresh' and 'redraw_projections'"):
        saved_config({"refresh": True, "redraw_projections": True})


def test_deprecated_names_parse_from_the_command_line_and_yaml(no_alias_warned_yet):
    parser = ArgumentParser()
    parser.add_argument("--logra", type=LoGRAConfig, default=LoGRAConfig())
    with pytest.warns(FutureWarning, match="LoGRAConfig.refresh is deprecated: use redraw_projections"):
        config = parser.instantiate_classes(parser.parse_args(["--logra.refresh=false", "--logra.rank=16"])).logra
    assert config.redraw_projections is False and config.rank == 16
    with pytest.warns(FutureWarning) as caught:
        config = parser.instantiate_classes(parser.parse_string("logra:\n  temperature: 0.9\n  row_chunk: 64\n")).logra
    assert (config.probe_temperature, config.update_chunk_rows) == (0.9, 64)
    warned = sorted(str(w.message).split(" is ")[0] for w in caught)
    assert warned == ["LoGRAConfig.row_chunk", "LoGRAConfig.temperature"]


# Validation (issue 23 item 9: finite, range, type; a bool is not a number) -----------------------
NUMBERS = ["beta2", "epsilon", "update_ratio", "kl_budget", "kl_budget_final", "alpha_max", "probe_temperature",
           "mismatch_ema_weight", "mismatch_budget_floor"]
INTEGERS = ["seed", "schedule_steps", "probe_responses", "probe_max_tokens", "probe_chunk_positions",
            "probe_mlp_chunk_tokens", "update_chunk_rows", "max_consecutive_skips"]
BOOLEANS = ["redraw_projections", "share_projection_by_input", "regenerate_projections", "follow_lr_schedule", "kl_control",
            "mismatch_subtraction"]


def test_every_field_is_checked_by_kind():
    checked = set(NUMBERS) | set(INTEGERS) | set(BOOLEANS) | {
        "rank", "distribution", "target_modules", "update_factor_dtype", "sketch_reduction", "sketch_accumulation", "kl_probe",
        "on_nonfinite"}
    assert checked == {f.name for f in dataclasses.fields(LoGRAConfig)}


def test_a_bool_seed_is_refused():
    with pytest.raises(ValueError, match=r"LoGRAConfig\.seed = True is invalid: must be an integer >= 0"):
        LoGRAConfig(seed=True)


@pytest.mark.parametrize("field", INTEGERS + NUMBERS)
def test_a_numeric_field_refuses_a_bool(field):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.{field} = True is invalid"):
        LoGRAConfig(**{field: True})


@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_number_field_refuses_a_non_finite_value(field, value):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.{field} = {value} is invalid: must be a finite number"):
        LoGRAConfig(**{field: value})


@pytest.mark.parametrize("field", INTEGERS)
def test_an_integer_field_refuses_a_float(field):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.{field} = 2.0 is invalid: must be an integer"):
        LoGRAConfig(**{field: 2.0})


@pytest.mark.parametrize("field", BOOLEANS)
def test_a_switch_refuses_anything_but_true_or_false(field):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.{field} = 1 is invalid: must be true or false"):
        LoGRAConfig(**{field: 1})


@pytest.mark.parametrize("seed", [2**63, 2**64])
def test_a_seed_past_64_bits_is_refused_at_construction(seed):
    with pytest.raises(ValueError, match=rf"LoGRAConfig\.seed = {seed} is invalid: must be an integer >= 0 and "
                                         r"<= 2\*\*63 - 1"):
        LoGRAConfig(seed=seed)
    assert LoGRAConfig(seed=2**63 - 1).seed == 2**63 - 1


def test_the_bounds_on_seeds_and_timeouts_fit_what_they_are_passed_to():
    torch.Generator().manual_seed(MAX_SEED + 2**32)  # room for the offsets added to a seed
    with pytest.raises(ValueError, match="Overflow"):
        torch.Generator().manual_seed(2**64)
    assert threading.Lock().acquire(timeout=MAX_TIMEOUT_S)  # what a timed wait on a thread comes down to
    with pytest.raises(OverflowError):
        threading.Lock().acquire(timeout=1e10)
