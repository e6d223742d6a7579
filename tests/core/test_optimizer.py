import json
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_logra import LoGRAConfig, LoGRAOptimizer
from lightning_logra.core.config import DEPRECATED_ALIASES
from tests.helpers.core import MLP_TARGETS, TokenMlp, token_batches, token_mlp_and_optimizer, token_mlp_train_step, weights


def test_construction_freezes_everything_and_tracks_the_targets():
    model, optimizer = token_mlp_and_optimizer()
    assert not any(p.requires_grad for p in model.parameters())
    assert [state.name for state in optimizer.sketches] == MLP_TARGETS
    assert optimizer.param_groups[0]["params"] == [model.up_proj.weight, model.down_proj.weight]
    assert optimizer.param_groups[0]["lr"] == 6e-5


def test_the_optimizer_keeps_a_private_copy_of_its_config():
    config = LoGRAConfig(rank=4, target_modules=list(MLP_TARGETS))
    optimizer = LoGRAOptimizer(TokenMlp(), config)
    config.update_ratio = 0.5
    config.target_modules.append("gate_proj")
    assert optimizer.config.update_ratio != 0.5
    assert optimizer.config.target_modules == MLP_TARGETS


def test_proposed_update_has_norm_update_ratio_times_weight_norm():
    model, optimizer = token_mlp_and_optimizer(update_ratio=1e-3)
    for tokens in token_batches(0):
        model(tokens).sum().backward()
    prepared = optimizer.prepare_update(normalization_tokens=36)
    weight_norm = math.sqrt(sum(w.double().pow(2).sum().item() for w in weights(optimizer)))
    update_norm = math.sqrt(
        sum((d.double() @ s.projection.double()).pow(2).sum().item() for d, s in zip(prepared.directions, optimizer.sketches))
    )
    # row norms in float32 (float32 round-off), summed in float64
    assert math.isclose(prepared.weight_norm, weight_norm, rel_tol=1e-7)
    assert math.isclose(update_norm, 1e-3 * weight_norm, rel_tol=1e-6)
    assert math.isclose(prepared.update_norm, update_norm, rel_tol=1e-6)


@pytest.mark.parametrize("factor_dtype", ["float32", "bfloat16"])
def test_applied_update_is_w_minus_alpha_d_a(factor_dtype):
    model, optimizer = token_mlp_and_optimizer(update_factor_dtype=factor_dtype)
    for tokens in token_batches(0):
        model(tokens).sum().backward()
    prepared = optimizer.prepare_update(normalization_tokens=36)
    directions = [d.clone() for d in prepared.directions]  # they live in the sketch buffer
    before = weights(optimizer)
    projections = [state.projection.clone() for state in optimizer.sketches]
    optimizer.apply_update(alpha=2.5)
    for w, d, a, after in zip(before, directions, projections, weights(optimizer)):
        scaled = (2.5 * d).to(getattr(torch, factor_dtype)).float()
        # W - (alpha D) A, fused into one rounding per entry (addmm) instead of two
        torch.testing.assert_close(after, torch.addmm(w, scaled, a, alpha=-1.0), rtol=0, atol=0)
        assert not torch.equal(after, w)
    assert optimizer.update_count == 1
    for state, old in zip(optimizer.sketches, projections):
        assert not torch.equal(state.projection, old)  # redrawn for the next update
        assert state.sketch.abs().sum() == 0


def test_projection_is_fixed_without_redrawing():
    model, optimizer = token_mlp_and_optimizer(redraw_projections=False)
    before = [state.projection.clone() for state in optimizer.sketches]
    token_mlp_train_step(model, optimizer, 0)
    assert all(torch.equal(s.projection, b) for s, b in zip(optimizer.sketches, before))


def test_learning_rate_scheduler_scales_the_update():
    model, optimizer = token_mlp_and_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer.param_groups[0]["lr"] == 3e-5
    for tokens in token_batches(0):
        model(tokens).sum().backward()
    prepared = optimizer.prepare_update(normalization_tokens=1)
    assert math.isclose(prepared.update_norm, 3e-5 * prepared.weight_norm, rel_tol=1e-6)
    del scheduler


def test_apply_without_prepared_update_is_an_error():
    _, optimizer = token_mlp_and_optimizer()
    with pytest.raises(RuntimeError, match="prepare_update"):
        optimizer.apply_update()


def test_prepare_without_backward_is_an_error():
    _, optimizer = token_mlp_and_optimizer()
    with pytest.raises(RuntimeError, match="no backward pass"):
        optimizer.prepare_update(normalization_tokens=1)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -1.0])
def test_bad_alpha_is_an_error_and_changes_nothing(alpha):
    model, optimizer = token_mlp_and_optimizer()
    model(token_batches(0)[0]).sum().backward()
    optimizer.prepare_update(normalization_tokens=1)
    before = weights(optimizer)
    with pytest.raises(FloatingPointError, match="alpha"):
        optimizer.apply_update(alpha=alpha)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(optimizer)))
    assert optimizer.update_count == 0


def test_bad_token_count_is_an_error():
    model, optimizer = token_mlp_and_optimizer()
    model(token_batches(0)[0]).sum().backward()
    with pytest.raises(ValueError, match="normalization_tokens"):
        optimizer.prepare_update(normalization_tokens=0)


def test_non_finite_sketch_raises_and_skip_update_keeps_state():
    model, optimizer = token_mlp_and_optimizer()
    model(token_batches(0)[0]).sum().backward()
    optimizer.sketches.states[1].sketch[0, 0] = float("nan")
    before = weights(optimizer)
    moments = [s.second_moment.clone() for s in optimizer.sketches]
    with pytest.raises(FloatingPointError, match="down_proj"):
        optimizer.prepare_update(normalization_tokens=1)
    optimizer.skip_update()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(optimizer)))
    assert all(torch.equal(s.second_moment, m) for s, m in zip(optimizer.sketches, moments))
    assert optimizer.update_count == 0 and optimizer.sketches.buffer.abs().sum() == 0
    token_mlp_train_step(model, optimizer, 1)  # and training goes on
    assert optimizer.update_count == 1


def test_skip_update_after_prepare_leaves_weights_moments_and_counter():
    model, optimizer = token_mlp_and_optimizer()
    model(token_batches(0)[0]).sum().backward()
    optimizer.prepare_update(normalization_tokens=1)
    moments = [s.second_moment.clone() for s in optimizer.sketches]
    optimizer.skip_update()
    assert all(torch.equal(s.second_moment, m) for s, m in zip(optimizer.sketches, moments))
    assert optimizer.update_count == 0 and optimizer.prepared is None


def test_target_used_functionally_is_named_at_the_first_step():
    class WithAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.up_proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.up_proj(self.attention(x, x, x)[0])

    model = WithAttention()
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=2, target_modules=["out_proj", "up_proj"]))
    model(torch.randn(2, 3, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="attention.out_proj"):
        optimizer.prepare_update(normalization_tokens=1)


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    model, optimizer = token_mlp_and_optimizer()
    for step in range(4):
        token_mlp_train_step(model, optimizer, step)

    first, first_optimizer = token_mlp_and_optimizer()
    for step in range(2):
        token_mlp_train_step(first, first_optimizer, step)
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, tmp_path / "ckpt.pt")

    resumed, resumed_optimizer = token_mlp_and_optimizer(init_seed=123)  # other initial weights: all must come from the checkpoint
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(2, 4):
        token_mlp_train_step(resumed, resumed_optimizer, step)

    assert resumed_optimizer.update_count == optimizer.update_count == 4
    for a, b in zip(resumed_optimizer.sketches, optimizer.sketches):
        assert torch.equal(a.weight, b.weight)
        assert torch.equal(a.second_moment, b.second_moment)
        assert torch.equal(a.projection, b.projection)


@pytest.mark.parametrize(("field", "value"), [("rank", 8), ("seed", 1), ("distribution", "gaussian"), ("target_modules", ["up_proj"])])
def test_loading_a_state_from_another_config_is_an_error(field, value):
    _, optimizer = token_mlp_and_optimizer()
    state = optimizer.state_dict()
    _, other = token_mlp_and_optimizer(**{field: value})
    with pytest.raises(ValueError, match=field):
        other.load_state_dict(state)


def with_old_field_names(state: dict) -> dict:
    """``state`` as a checkpoint written before the renames (DEPRECATED_ALIASES) holds it."""
    config = json.loads(bytes(state["config"].tolist()).decode())
    for old, new in DEPRECATED_ALIASES.items():
        config[old] = config.pop(new)
    encoded = json.dumps(config, sort_keys=True).encode()
    return {**state, "config": torch.tensor(list(encoded), dtype=torch.uint8)}


def test_a_checkpoint_written_under_the_old_field_names_resumes_silently():
    model, optimizer = token_mlp_and_optimizer(update_chunk_rows=100)
    token_mlp_train_step(model, optimizer, 0)
    state = with_old_field_names(optimizer.state_dict())
    _, resumed = token_mlp_and_optimizer(update_chunk_rows=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a deprecation nor a "changed settings" warning
        resumed.load_state_dict(state)
    assert resumed.update_count == 1


def test_a_checkpoint_under_the_old_field_names_is_still_compared_field_by_field():
    _, optimizer = token_mlp_and_optimizer(redraw_projections=False, update_chunk_rows=100)
    state = with_old_field_names(optimizer.state_dict())
    _, other = token_mlp_and_optimizer()
    with pytest.raises(ValueError, match="redraw_projections: False != True"):
        other.load_state_dict(state)
    _, retuned = token_mlp_and_optimizer(redraw_projections=False)
    assert retuned.check_state(state) == ["update_chunk_rows: 100 -> 256"]


def test_state_dict_holds_moments_counter_and_mismatch():
    model, optimizer = token_mlp_and_optimizer()
    token_mlp_train_step(model, optimizer, 0)
    optimizer.controller.mismatch = 0.25
    state = optimizer.state_dict()
    assert state["update_count"].item() == 1 and state["mismatch"].item() == 0.25
    assert set(state["second_moments"]) == set(MLP_TARGETS)
    assert state["second_moments"]["up_proj"].shape == (300, 1)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_non_finite_mismatch_ema_in_a_checkpoint_is_refused_before_anything_loads(value):
    model, optimizer = token_mlp_and_optimizer()
    token_mlp_train_step(model, optimizer, 0)
    state = {**optimizer.state_dict(), "mismatch": torch.tensor([value], dtype=torch.float64)}
    _, resumed = token_mlp_and_optimizer()
    with pytest.raises(ValueError, match="mismatch EMA in the checkpoint is (inf|nan)"):
        resumed.load_state_dict(state)
    assert resumed.update_count == 0 and resumed.controller.mismatch == 0.0
