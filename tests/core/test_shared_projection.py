"""share_projection_by_input: q/k/v of one attention block and gate/up of one MLP share
one projection A, so P = X A^T is computed once per group; each layer keeps its own sketch."""

import pytest
import torch
from torch import nn

from lightning_logra import (
    LoGRAConfig,
    LoGRAOptimizer,
    LoGRAStepInputs,
    ProbeBatch,
    install_sketches,
    make_projection,
    projection_seed,
)
from lightning_logra.core import projection as projection_module
from lightning_logra.core.projected_input import projection_groups
from lightning_logra.core.sketch import find_targets
from tests.helpers.core import count_projections_by_matrix, qwen2_train_step, tokens_2x7
from tests.helpers.models import tiny_qwen2

RANK = 16
SHARED = LoGRAConfig(rank=RANK, share_projection_by_input=True)


def test_groups_are_qkv_and_gate_up_of_each_block():
    targets = find_targets(tiny_qwen2(), LoGRAConfig().target_modules)
    names = [[targets[i][0].rsplit(".", 2)[-2] + "." + targets[i][0].rsplit(".", 1)[-1] for i in group]
             for group in projection_groups(targets)]
    per_layer = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                 ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    assert names == per_layer * 2


def test_group_members_hold_one_projection_drawn_from_the_first_members_seed():
    model = tiny_qwen2()
    states = {state.name: state for state in install_sketches(model, SHARED)}
    alone = {state.name: state for state in install_sketches(tiny_qwen2(), LoGRAConfig(rank=RANK))}
    q = "model.layers.1.self_attn.q_proj"
    shared = states[q].projection
    assert states["model.layers.1.self_attn.k_proj"].projection is shared
    assert states["model.layers.1.self_attn.v_proj"].projection is shared
    assert states["model.layers.1.mlp.up_proj"].projection is states["model.layers.1.mlp.gate_proj"].projection
    assert states["model.layers.1.self_attn.o_proj"].projection is not shared
    # The group's A is the one its first member draws alone: seeded by that member's name.
    assert torch.equal(shared, make_projection(RANK, 32, projection_seed(42, 0, q)))
    assert torch.equal(shared, alone[q].projection)
    assert not torch.equal(shared, alone["model.layers.1.self_attn.k_proj"].projection)
    assert states["model.layers.1.self_attn.v_proj"].projection_name == q


def test_without_sharing_every_layer_draws_its_own_projection_from_its_name():
    sketches = install_sketches(tiny_qwen2(), LoGRAConfig(rank=RANK))
    assert len(sketches.projections()) == len(sketches) == 14
    for state in sketches:
        expected = make_projection(RANK, state.module.in_features, projection_seed(42, 0, state.name))
        assert state.projection_name == state.name and torch.equal(state.projection, expected)


def test_a_shared_projection_is_stored_once():
    sketches = install_sketches(tiny_qwen2(), SHARED)
    assert len(sketches) == 14 and len(sketches.projections()) == 8  # 2 layers x (qkv, o, gate/up, down)
    assert len({state.projection.data_ptr() for state in sketches}) == 8
    assert sketches.buffer.numel() == sum(state.module.out_features for state in sketches) * RANK  # own sketches


def test_projection_is_computed_once_per_group_per_forward(monkeypatch):
    model = tiny_qwen2().train()
    sketches = install_sketches(model, SHARED)
    calls = count_projections_by_matrix(monkeypatch)
    model(tokens_2x7()).logits.sum().backward()
    assert len(calls) == 8 and len(set(calls)) == 8  # each distinct A projected exactly once
    assert all(state.backward_calls == 1 for state in sketches)
    assert all(state.shared_input is None or state.shared_input.inputs is None for state in sketches)  # released


def test_each_sketch_equals_dy_transpose_x_a_transpose_with_the_shared_projection():
    model = tiny_qwen2().train()
    sketches = install_sketches(model, SHARED)
    inputs, grads = {}, {}
    for state in sketches:
        def remember(module, args, output, name=state.name):
            inputs[name] = args[0].detach()
            output.register_hook(lambda grad: grads.__setitem__(name, grad.detach()))
        state.handles.append(state.module.register_forward_hook(remember))  # runs after the sketch hook
    model(tokens_2x7()).logits.square().sum().backward()
    for state in sketches:
        x = inputs[state.name].reshape(-1, state.module.in_features)
        dy = grads[state.name].reshape(-1, state.module.out_features)
        # The same float32 operations on the same operands as the hook and its backward
        # (P = X A^T, then S = 0 + dY^T P by addmm): equal bit for bit.
        expected = torch.zeros_like(state.sketch).addmm_(dy.T, x @ state.projection.T)
        assert torch.equal(state.sketch, expected), state.name
    q, k = sketches.states[0], sketches.states[1]
    assert torch.equal(inputs[q.name], inputs[k.name])  # the group really read one input


class CrossAttention(nn.Module):
    """q reads one tensor, k and v another: a group whose members do not share one input."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return (self.q_proj(x) * self.k_proj(memory)).sum(-1, keepdim=True) * self.v_proj(memory)


def test_members_reading_different_inputs_project_each_input(monkeypatch):
    torch.manual_seed(0)
    dense, logra = CrossAttention().double(), CrossAttention().double()
    logra.load_state_dict(dense.state_dict())
    sketches = install_sketches(logra, LoGRAConfig(rank=4, share_projection_by_input=True))
    assert len(sketches.projections()) == 1
    calls = count_projections_by_matrix(monkeypatch)
    x, memory = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    dense(x, memory).square().sum().backward()
    logra(x, memory).square().sum().backward()
    assert len(calls) == 2  # x for q; memory for k, reused by v
    for state, layer in zip(sketches, (dense.q_proj, dense.k_proj, dense.v_proj)):
        expected = layer.weight.grad @ state.projection.double().T
        torch.testing.assert_close(state.sketch.double(), expected, rtol=1e-5, atol=1e-6)


class InPlace(nn.Module):
    """q and k read one tensor object, changed in place between the two reads."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        q = self.q_proj(h)
        h.mul_(2.0)
        return q * self.k_proj(h)


def test_an_input_changed_in_place_between_members_is_projected_again(monkeypatch):
    torch.manual_seed(0)
    model = InPlace()
    sketches = install_sketches(model, LoGRAConfig(rank=4, share_projection_by_input=True))
    inputs, grads = {}, {}
    for state in sketches:
        def remember(module, args, output, name=state.name):
            inputs[name] = args[0].detach().clone()
            output.register_hook(lambda grad: grads.__setitem__(name, grad.detach()))
        state.handles.append(state.module.register_forward_hook(remember))
    calls = count_projections_by_matrix(monkeypatch)
    model(torch.randn(5, 8)).square().sum().backward()
    assert len(calls) == 2
    for state in sketches:
        expected = torch.zeros_like(state.sketch).addmm_(grads[state.name].T, inputs[state.name] @ state.projection.T)
        assert torch.equal(state.sketch, expected), state.name


def test_redraw_after_an_update_draws_each_shared_projection_once_and_keeps_it_shared(monkeypatch):
    model = tiny_qwen2().train()
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=RANK, share_projection_by_input=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    states = {state.name: state for state in optimizer.sketches}
    q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    before = states[q].projection.clone()
    draws = []
    original = projection_module.make_projection
    monkeypatch.setattr(projection_module, "make_projection", lambda *a, **k: draws.append(a) or original(*a, **k))
    qwen2_train_step(model, optimizer, 0)
    assert len(draws) == 4  # 2 layers x (q/k/v, o), not 8
    assert states[v].projection is states[q].projection
    assert torch.equal(states[q].projection, make_projection(RANK, 32, projection_seed(42, 1, q)))
    assert not torch.equal(states[q].projection, before)


def test_probe_and_step_run_with_shared_projections():
    model = tiny_qwen2().train()
    optimizer = LoGRAOptimizer(model, SHARED)
    batch = tokens_2x7()
    model(input_ids=batch, labels=batch).loss.backward()
    report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)))
    assert not report.skipped and report.predicted_kl > 0 and optimizer.update_count == 1


def test_resume_with_sharing_is_bit_identical(tmp_path):
    def make():
        model = tiny_qwen2().train()
        return model, LoGRAOptimizer(model, LoGRAConfig(rank=RANK, share_projection_by_input=True))

    model, optimizer = make()
    for step in range(3):
        qwen2_train_step(model, optimizer, step)
    first, first_optimizer = make()
    qwen2_train_step(first, first_optimizer, 0)
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, tmp_path / "ckpt.pt")
    resumed, resumed_optimizer = make()
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for step in (1, 2):
        qwen2_train_step(resumed, resumed_optimizer, step)
    for a, b in zip(resumed_optimizer.sketches, optimizer.sketches):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.projection, b.projection)
    assert resumed_optimizer.sketches.states[1].projection is resumed_optimizer.sketches.states[0].projection


def test_a_state_saved_without_sharing_cannot_be_resumed_with_it():
    optimizer = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=RANK))
    other = LoGRAOptimizer(tiny_qwen2(), SHARED)
    with pytest.raises(ValueError, match="share_projection_by_input: False != True"):
        other.load_state_dict(optimizer.state_dict())
