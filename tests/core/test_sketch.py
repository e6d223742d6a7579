import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_logra import LoGRAConfig, install_sketches, remove_sketches
from tests.helpers.core import KeywordCalledLinear

RANK = 4
# The sketch is accumulated in float32 while the dense reference below is float64, and the
# two sum the same products in a different order: agreement to float32 round-off.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.up_proj = nn.Linear(8, 12)
        self.down_proj = nn.Linear(12, 8)
        self.head = nn.Linear(8, 5)
        self.checkpointed = checkpointed

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down_proj(torch.tanh(self.up_proj(h)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = checkpoint(self.mlp, h, use_reentrant=False) if self.checkpointed else self.mlp(h)
        return self.head(h)


def _pair(checkpointed: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    dense = Block(checkpointed).double()
    logra = Block(checkpointed).double()
    logra.load_state_dict(dense.state_dict())
    for parameter in list(logra.parameters()) + list(dense.parameters()):
        parameter.requires_grad_(False)
    for layer in (dense.up_proj, dense.down_proj):
        layer.weight.requires_grad_(True)
    return dense, logra


def _micro_batches(count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 11, (2, 5), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_sketch_equals_dense_gradient_times_projection(checkpointed):
    dense, logra = _pair(checkpointed)
    sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj", "down_proj"]))
    for tokens in _micro_batches():
        dense(tokens).square().sum().backward()
        logra(tokens).square().sum().backward()
    for state, layer in zip(sketches, (dense.up_proj, dense.down_proj)):
        assert state.weight.grad is None and not state.weight.requires_grad
        expected = layer.weight.grad @ state.projection.double().T
        torch.testing.assert_close(state.sketch.double(), expected, **TOLERANCE)
        assert state.backward_calls == 3


def test_first_target_gets_a_sketch_behind_frozen_embeddings():
    dense, logra = _pair()
    sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj"]))
    tokens = _micro_batches(1)[0]
    dense(tokens).sum().backward()
    logra(tokens).sum().backward()
    state = sketches.states[0]
    assert state.sketch.abs().sum() > 0
    torch.testing.assert_close(state.sketch.double(), dense.up_proj.weight.grad @ state.projection.double().T, **TOLERANCE)


def test_input_gradients_are_identical_to_the_dense_model():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    logra = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    logra.load_state_dict(dense.state_dict())
    install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["0", "2"]))
    x = torch.randn(7, 6)
    x_dense, x_logra = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    dense(x_dense).square().sum().backward()
    logra(x_logra).square().sum().backward()
    assert torch.equal(x_dense.grad, x_logra.grad)


def test_projected_activations_are_freed_after_backward_while_the_loss_lives():
    _, logra = _pair()
    install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj", "down_proj"]))
    saved: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 2 and tensor.shape[1] == RANK:
            saved.append(weakref.ref(tensor))
        return tensor

    losses = []
    for tokens in _micro_batches():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = logra(tokens).square().sum()
        loss.backward()
        losses.append(loss)  # keeps each graph object alive
    assert len(saved) == 6  # one P per target per micro-batch
    assert all(ref() is None for ref in saved)


def test_state_dict_keys_are_unchanged_and_hooks_are_removable():
    _, logra = _pair()
    keys = list(logra.state_dict())
    sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj", "down_proj"]))
    assert list(logra.state_dict()) == keys
    remove_sketches(sketches)
    logra.head.weight.requires_grad_(True)
    logra(_micro_batches(1)[0]).sum().backward()
    assert sketches.buffer.abs().sum() == 0


def test_no_sketch_work_without_grad():
    _, logra = _pair()
    sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj"]))
    with torch.no_grad():
        out = logra(_micro_batches(1)[0])
    assert not out.requires_grad and sketches.states[0].backward_calls == 0


def test_non_linear_target_is_a_type_error_naming_it():
    model = nn.Module()
    model.q_proj = nn.Conv1d(3, 3, 1)
    with pytest.raises(TypeError, match="'q_proj' is a Conv1d"):
        install_sketches(model, LoGRAConfig(rank=2))


def test_no_matching_target_is_a_value_error():
    with pytest.raises(ValueError, match="no module of Sequential matches"):
        install_sketches(nn.Sequential(nn.Linear(2, 2)), LoGRAConfig(rank=2))


def test_sketches_share_one_flat_float32_buffer():
    _, logra = _pair()
    sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj", "down_proj"]))
    assert sketches.buffer.dtype == torch.float32 and sketches.buffer.numel() == (12 + 8) * RANK
    sketches.states[1].sketch.fill_(2.0)
    assert sketches.buffer[12 * RANK :].eq(2.0).all()
    sketches.zero_()
    assert sketches.buffer.eq(0).all()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_a_target_called_with_input_as_a_keyword_gets_the_same_sketch(checkpointed):
    sketched = []
    for keyword in (False, True):
        _, logra = _pair(checkpointed)
        if keyword:
            logra.up_proj.__class__ = logra.down_proj.__class__ = KeywordCalledLinear
        sketches = install_sketches(logra, LoGRAConfig(rank=RANK, target_modules=["up_proj", "down_proj"]))
        for tokens in _micro_batches():
            logra(tokens).square().sum().backward()
        sketched.append([state.sketch.clone() for state in sketches])
    for keyword, positional in zip(*reversed(sketched)):
        assert positional.abs().sum() > 0 and torch.equal(keyword, positional)
