"""Plain-torch builders for the optimizer tests: two small MLPs, LoGRAOptimizers around them
and around a tiny Qwen2, their batches and steps, and a Qwen2 with an update prepared for the
KL probe."""

from __future__ import annotations

import torch
from torch import nn

from lightning_logra import LoGRAConfig, LoGRAOptimizer
from lightning_logra.core import projected_input as projected_input_module
from lightning_logra.core import sketch as sketch_module
from tests.helpers.models import PROBE_VOCAB, probe_qwen2, tiny_qwen2

MLP_TARGETS = ["up_proj", "down_proj"]
QWEN2_VOCAB = 64


def weights(optimizer: LoGRAOptimizer) -> list[torch.Tensor]:
    """Copies of the target weights (plain tensors: one process)."""
    return [state.weight.detach().clone() for state in optimizer.sketches]


def full(weight):
    """The whole of a weight: gathered if it is an FSDP2 shard (a collective: every rank calls it)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight.detach().clone()


def _record_projections(monkeypatch, entry) -> list:
    calls = []
    original = projected_input_module.project

    def counting(inputs, projection):
        calls.append(entry(projection))
        return original(inputs, projection)

    for module in (sketch_module, projected_input_module):  # both call it
        monkeypatch.setattr(module, "project", counting)
    return calls


def count_projections_by_phase(monkeypatch) -> list[str]:
    """Record every P = X A^T the sketch hooks compute, tagged with the phase it ran in."""
    return _record_projections(monkeypatch, lambda projection: "backward" if torch._C._current_graph_task_id() != -1 else "forward")


def count_projections_by_matrix(monkeypatch) -> list[int]:
    """Record every P = X A^T the sketch hooks compute, as the id of the projection A it used."""
    return _record_projections(monkeypatch, id)


class KeywordCalledLinear(nn.Linear):
    """An nn.Linear that its parent calls as ``layer(input=x)``: hooks see X in kwargs
    (assign it to a module's ``__class__``)."""

    def __call__(self, x):
        return super().__call__(input=x)


# -- TokenMlp: tokens in, logits out; up_proj has 300 rows, two of the update's row chunks --


class TokenMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.up_proj = nn.Linear(8, 300)  # > 256 rows: the update runs in two row chunks
        self.down_proj = nn.Linear(300, 8)
        self.head = nn.Linear(8, 13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down_proj(torch.relu(self.up_proj(h))))


def token_mlp_and_optimizer(init_seed: int = 0, **overrides) -> tuple[TokenMlp, LoGRAOptimizer]:
    """A TokenMlp drawn with ``init_seed`` and a rank-16 optimizer on up_proj and down_proj."""
    torch.manual_seed(init_seed)
    model = TokenMlp()
    config = LoGRAConfig(**{"rank": 16, "target_modules": MLP_TARGETS, **overrides})
    return model, LoGRAOptimizer(model, config)


def token_batches(step: int, count: int = 2) -> list[torch.Tensor]:
    """``count`` micro-batches of 3 sequences of 6 tokens, the same for a given ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, 13, (3, 6), generator=generator) for _ in range(count)]


def token_mlp_train_step(model: TokenMlp, optimizer: LoGRAOptimizer, step: int, alpha: float = 1.0) -> None:
    """One update on ``step``'s two micro-batches: next-token cross-entropy summed over the
    30 predicted tokens, normalised by them, scaled by ``alpha``."""
    optimizer.zero_grad()
    for tokens in token_batches(step):
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 13), tokens[:, 1:].reshape(-1), reduction="sum").backward()
    optimizer.prepare_update(normalization_tokens=2 * 3 * 5)
    optimizer.apply_update(alpha=alpha)


# -- OddRowMlp: vectors in and out; up_proj has 301 rows, which FSDP2 splits 151 + 150 --


class OddRowMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(8, 301)  # odd row count: FSDP2 splits it 151 + 150
        self.down_proj = nn.Linear(301, 8)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.up_proj(x)))


# -- A tiny Qwen2 (64 tokens) under a LoGRAOptimizer with the KL controller on --


def qwen2_and_optimizer(**overrides) -> tuple[nn.Module, LoGRAOptimizer]:
    """``tiny_qwen2`` in training mode; rank 8, update ratio 1e-2, a KL budget from 1e-4 to
    1e-5 over 4 steps."""
    model = tiny_qwen2(QWEN2_VOCAB)
    model.train()
    config = LoGRAConfig(**{"rank": 8, "update_ratio": 1e-2, "kl_budget": 1e-4, "kl_budget_final": 1e-5,
                            "schedule_steps": 4, **overrides})
    return model, LoGRAOptimizer(model, config)


def tokens_4x10(step: int) -> torch.Tensor:
    """4 sequences of 10 tokens, seeded by ``step``."""
    return torch.randint(0, QWEN2_VOCAB, (4, 10), generator=torch.Generator().manual_seed(step))


def backward(model, optimizer, step: int) -> torch.Tensor:
    """Zero the sketches, then one backward of the LM loss on ``tokens_4x10(step)``; returns the batch."""
    optimizer.zero_grad()
    batch = tokens_4x10(step)
    model(input_ids=batch, labels=batch).loss.backward()
    return batch


def tokens_2x7(seed: int = 0) -> torch.Tensor:
    """2 sequences of 7 tokens, seeded by ``seed``."""
    return torch.randint(0, QWEN2_VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def qwen2_train_step(model: nn.Module, optimizer: LoGRAOptimizer, step: int) -> None:
    """One unscaled update (alpha = 1, normalised by 1 token) on the LM loss of ``tokens_2x7(step)``."""
    optimizer.zero_grad()
    batch = tokens_2x7(step)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.prepare_update(normalization_tokens=1)
    optimizer.apply_update(alpha=1.0)


# -- The KL probe: a Qwen2 (97 tokens) with one update prepared, and sequences to probe --


def probe_sequences() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 sequences of 12 tokens (the third left-padded by 3) whose last 7 tokens were
    "generated": input ids, attention mask, and the mask of logits that score them."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, PROBE_VOCAB, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, :3] = 0  # a left-padded row
    completion = torch.zeros_like(input_ids)
    completion[:, 5:] = 1  # the last 7 tokens were "generated"
    logits_mask = completion[:, 1:].bool()
    logits_mask = torch.cat([logits_mask, torch.zeros(3, 1, dtype=torch.bool)], dim=1)
    return input_ids, attention_mask, logits_mask


def prepared_probe_model(attention: str = "eager"):
    """``probe_qwen2`` and its optimizer (rank 16, float32 factors) with an update prepared
    from the LM loss of ``probe_sequences``, not yet applied."""
    model = probe_qwen2(attention)
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=16, update_ratio=2e-3, update_factor_dtype="float32"))
    input_ids, attention_mask, _ = probe_sequences()
    model.train()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, PROBE_VOCAB), input_ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.prepare_update(normalization_tokens=1)
    return model, optimizer
