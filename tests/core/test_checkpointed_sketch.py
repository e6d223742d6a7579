"""Under non-reentrant activation checkpointing the sketch hook saves X and computes
P = X A^T once, in backward, instead of in the forward (whose P the checkpoint drops) and
again in the recompute. The sketches must not change by a single bit."""

import weakref
from collections import Counter

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRAConfig, install_sketches
from lightning_logra.core import projected_input as projected_input_module
from lightning_logra.core import sketch as sketch_module
from lightning_logra.models.loading import enable_activation_checkpointing
from lightning_logra.core.projected_input import under_activation_checkpointing
from tests.helpers.core import count_projections_by_phase

VOCAB = 48
TARGETS_PER_LAYER = 7
LAYERS = 2


def tiny_model(kind: str) -> torch.nn.Module:
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


def pair(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two copies of one model, the second with HF activation checkpointing; both in
    training mode (HF checkpoints only there; these configs have no dropout)."""
    plain, checkpointed = tiny_model(kind), tiny_model(kind)
    checkpointed.load_state_dict(plain.state_dict())
    enable_activation_checkpointing(checkpointed)
    return plain.train(), checkpointed.train()


def micro_batches(count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 9), generator=generator) for _ in range(count)]


def run(model: torch.nn.Module, config: LoGRAConfig, autocast: bool = False) -> torch.Tensor:
    sketches = install_sketches(model, config)
    for tokens in micro_batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    assert all(state.backward_calls == 2 for state in sketches)
    return sketches.buffer.clone()


def test_detects_non_reentrant_checkpointing_in_its_forward_and_recompute_only():
    seen = []

    def block(x):
        seen.append(under_activation_checkpointing())
        return (x * x).sum()

    x = torch.randn(3, requires_grad=True)
    block(x).backward()
    checkpoint(block, x, use_reentrant=False).backward()  # forward, then the recompute in backward
    with torch.autograd.graph.save_on_cpu():  # other saved-tensor hooks are not checkpointing
        block(x)
    assert seen == [False, True, True, False]


def test_detects_torch_distributed_checkpoint_wrappers():
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    seen = []

    class Block(torch.nn.Module):
        def forward(self, x):
            seen.append(under_activation_checkpointing())
            return (x * x).sum()

    x = torch.randn(3, requires_grad=True)
    checkpoint_wrapper(Block())(x).backward()
    composable = Block()
    composable_checkpoint(composable)  # what FSDP2 users apply per layer
    composable(x).backward()
    assert seen == [True, True, True, True]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_checkpointed_sketch_is_bit_identical_to_the_plain_run(kind, monkeypatch):
    plain, checkpointed = pair(kind)
    config = LoGRAConfig(rank=16)
    calls = count_projections_by_phase(monkeypatch)
    expected = run(plain, config)
    assert calls == ["forward"] * TARGETS_PER_LAYER * LAYERS * 2
    calls.clear()
    actual = run(checkpointed, config)
    assert torch.equal(actual, expected)
    assert expected.abs().sum() > 0
    # Once per target and micro-batch, and only in backward: the forward's P (which the
    # checkpoint would drop) and the recompute's are no longer computed.
    assert calls == ["backward"] * TARGETS_PER_LAYER * LAYERS * 2


def test_checkpointed_sketch_is_bit_identical_under_bfloat16_autocast():
    # P is computed in backward under the forward's autocast state: a bfloat16 matmul of
    # float32 X, exactly as in the forward.
    plain, checkpointed = pair("qwen2")
    config = LoGRAConfig(rank=16)
    assert torch.equal(run(checkpointed, config, autocast=True), run(plain, config, autocast=True))


def test_checkpointed_sketch_is_bit_identical_with_shared_projections(monkeypatch):
    plain, checkpointed = pair("qwen2")
    config = LoGRAConfig(rank=16, share_projection_by_input=True)
    expected = run(plain, config)
    calls = count_projections_by_phase(monkeypatch)
    assert torch.equal(run(checkpointed, config), expected)
    groups_per_layer = 4  # q/k/v, o, gate/up, down
    assert calls == ["backward"] * groups_per_layer * LAYERS * 2


def test_eval_mode_is_not_checkpointed_and_keeps_the_forward_path(monkeypatch):
    _, checkpointed = pair("qwen2")
    checkpointed.eval()  # HF checkpoints only in training mode
    calls = count_projections_by_phase(monkeypatch)
    run(checkpointed, LoGRAConfig(rank=16))
    assert calls == ["forward"] * TARGETS_PER_LAYER * LAYERS * 2


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_saved_inputs_and_projections_are_freed_after_backward_while_the_loss_lives(shared, monkeypatch):
    _, checkpointed = pair("qwen2")
    install_sketches(checkpointed, LoGRAConfig(rank=16, share_projection_by_input=shared))
    alive: list[weakref.ref] = []
    original = projected_input_module.project

    def tracking(inputs, projection):
        projected = original(inputs, projection)
        alive.extend([weakref.ref(inputs), weakref.ref(projected)])
        return projected

    for module in (sketch_module, projected_input_module):  # both call it
        monkeypatch.setattr(module, "project", tracking)
    losses = []
    for tokens in micro_batches():
        loss = checkpointed(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss)  # keeps each graph object alive
    projections_per_layer = 4 if shared else TARGETS_PER_LAYER  # shared: q/k/v, o, gate/up, down
    assert len(alive) == 2 * projections_per_layer * LAYERS * 2
    assert all(ref() is None for ref in alive)


def linear_forward_counts(model: torch.nn.Module) -> Counter:
    """How often each Linear's matmul ran in one forward and backward (counted first among
    the forward hooks: a later one may stop the recompute)."""
    counts: Counter = Counter()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda module, args, output, name=name: counts.update([name]), prepend=True)
    tokens = micro_batches(1)[0]
    model(input_ids=tokens, labels=tokens).loss.backward()
    return counts


def test_the_recompute_stops_before_the_last_target_as_it_does_without_logra():
    # Non-reentrant checkpointing stops its recompute at the region's last saved tensor. X
    # saved after the matmul made it redo down_proj's matmul, the largest of a decoder
    # layer, only to save X again; saved before it, the recompute stops where dense
    # training's does. Everything else frozen, as LoGRAOptimizer leaves it, so layer 0's
    # q/k/v (whose input needs no grad) take the fallback that saves X after the matmul.
    _, dense = pair("qwen2")
    _, logra = pair("qwen2")
    logra.requires_grad_(False)
    install_sketches(logra, LoGRAConfig(rank=16))
    expected = linear_forward_counts(dense)
    assert expected["model.layers.1.mlp.down_proj"] == 1 and expected["model.layers.1.mlp.up_proj"] == 2
    assert linear_forward_counts(logra) == expected
