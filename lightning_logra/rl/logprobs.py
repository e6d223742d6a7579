"""Per-token log-probabilities without materialising full-vocabulary logits.

The LM head turns a few thousand positions into vocab-sized float32 rows; for a 150k
vocabulary that is the largest tensor of an RL step. ``token_logprobs`` computes the
head in chunks of positions and checkpoints each chunk, so at most one chunk of logits
exists at a time, in forward and in backward (which recomputes the chunk's logits).
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# 256 positions x a 152k vocabulary is 150 MiB of float32 logits per chunk, about what one
# decoder layer of a 1.5B model holds for 2k tokens; larger chunks make the head the peak.
DEFAULT_CHUNK_SIZE = 256


def token_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` under ``softmax((hidden @ W.T + b) / temperature)``.

    ``hidden`` is ``(..., H)`` and ``targets`` the matching ``(...)`` token ids; the result
    has the shape of ``targets`` and is float32. With ``return_entropy`` the entropy of each
    position's distribution (same temperature) is returned as well.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share all but the last dim"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    tracks_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, head_weight, head_bias)
    )
    chunks = []
    for start in range(0, flat_targets.numel(), chunk_size):
        args = (
            flat_hidden[start : start + chunk_size],
            head_weight,
            head_bias,
            flat_targets[start : start + chunk_size],
            temperature,
            return_entropy,
        )
        # Checkpointing frees the chunk's logits after forward; backward recomputes them.
        if tracks_grad:
            chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_chunk_logprobs(*args))
    logprobs = torch.cat([c[0] for c in chunks]).reshape(targets.shape)
    if not return_entropy:
        return logprobs
    return logprobs, torch.cat([c[1] for c in chunks]).reshape(targets.shape)


def _chunk_logprobs(hidden, weight, bias, targets, temperature, with_entropy):
    logprobs = _chunk_log_softmax(hidden, weight, bias, temperature)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1) if with_entropy else None
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@dataclass
class ForwardDraw:
    """Fresh tokens to draw in a forward that computes log-probs anyway (the training
    forward, so that ``policy/step_kl`` needs no forward of its own before the step): at
    every position of the micro-batch's rows ``rows``, ``tokens.shape[-1]`` tokens drawn
    with replacement by ``generator`` from the next-token distribution at the forward's
    temperature, and their log-probs, without a gradient. They are written to
    ``tokens[slots[i]]`` / ``logprobs[slots[i]]`` for ``rows[i]`` (``slots x (T-1) x
    samples``; a packed forward leaves positions without a next real token untouched);
    ``seconds`` adds up the wall clock spent drawing."""

    rows: torch.Tensor
    slots: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    generator: torch.Generator
    seconds: float = 0.0

    def fill(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
             columns: torch.Tensor, temperature: float, chunk_size: int) -> None:
        """Draw at the positions whose hidden states are ``hidden`` (``N x H``), position i
        being column ``columns[i]`` of the row drawn into slot ``slots[i]``."""
        started = time.perf_counter()
        with torch.no_grad():
            tokens, logprobs = _drawn_tokens(hidden, weight, bias, samples=self.tokens.shape[-1],
                                             generator=self.generator, temperature=temperature, chunk_size=chunk_size)
            self.tokens[slots, columns] = tokens
            self.logprobs[slots, columns] = logprobs
        self.seconds += time.perf_counter() - started


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    draw: ForwardDraw | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token of a Hugging Face causal LM: ``out[:, t] = log p(ids[:, t+1] | ids[:, :t+1])``.

    Returns float32 ``B x (T-1)`` (and the entropies with ``return_entropy``). Position ids
    follow the attention mask, as in ``generate``, so left-padded rows score exactly as
    they were sampled. Values at padding positions are meaningless: mask them. ``draw``
    also draws fresh tokens at its rows' positions (``ForwardDraw``).
    """
    _check_rows(input_ids, attention_mask)
    head = _token_logprobs_head(input_ids[:, 1:], temperature, chunk_size, return_entropy)
    if draw is not None:
        length = input_ids.shape[1] - 1
        slots = draw.slots.repeat_interleave(length)
        columns = torch.arange(length, device=input_ids.device).repeat(len(draw.rows))
        head = _drawing_head(head, draw, lambda hidden: hidden[draw.rows].flatten(0, 1), slots, columns,
                             temperature, chunk_size)
    scores = _head_in_forward(model, _padded_inputs(input_ids, attention_mask), None, head)
    return (scores[..., 0], scores[..., 1]) if return_entropy else scores


def packed_sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    draw: ForwardDraw | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logprobs`` of the same padded rows, computed as one packed row of their
    real tokens: no padding position runs through the model or its head (nor draws, with
    ``draw``).

    The rows' real tokens (contiguous in each row) are laid end to end with position ids
    restarting at 0 per sequence and no attention mask, from which transformers derives
    each sequence's own causal mask (``find_packed_sequence_indices``). Returns the padded
    ``B x (T-1)`` layout, 0 at the positions that predict no real token of the same row."""
    _check_rows(input_ids, attention_mask)
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    first = real.long().argmax(dim=1)
    last = real.shape[1] - 1 - real.long().flip(1).argmax(dim=1)
    gapped = (lengths > 0) & (last - first + 1 != lengths)
    if gapped.any():
        raise ValueError(f"attention_mask row {int(gapped.nonzero()[0])} has padding between real tokens: "
                         "packing needs each row's real tokens contiguous")
    rows, columns = real.nonzero(as_tuple=True)  # row-major: the packed order
    packed_ids = input_ids[rows, columns].unsqueeze(0)
    starts = torch.cumsum(lengths, 0) - lengths
    position_ids = (torch.arange(rows.numel(), device=rows.device) - starts[rows]).unsqueeze(0)
    # Packed token j predicts token j + 1 where both belong to the same row, i.e. where the
    # next column of the padded row is real: the padded layout's scored positions.
    next_column = (columns + 1).clamp(max=real.shape[1] - 1)
    scored = ((columns + 1 < real.shape[1]) & real[rows, next_column])[:-1]
    inputs = {"input_ids": packed_ids, "position_ids": position_ids}
    head = _token_logprobs_head(packed_ids[0, 1:][scored], temperature, chunk_size, return_entropy)
    where = (rows[:-1][scored], columns[:-1][scored])
    if draw is not None:
        slot_of_row = torch.full((input_ids.shape[0],), -1, dtype=torch.long, device=input_ids.device)
        slot_of_row[draw.rows] = draw.slots
        drawn = slot_of_row[where[0]] >= 0
        head = _drawing_head(head, draw, lambda hidden: hidden[drawn], slot_of_row[where[0]][drawn], where[1][drawn],
                             temperature, chunk_size)
    scores = _head_in_forward(model, inputs, scored, head)
    values = (scores[..., 0], scores[..., 1]) if return_entropy else scores

    def padded(packed: torch.Tensor) -> torch.Tensor:
        return packed.new_zeros(input_ids.shape[0], input_ids.shape[1] - 1).index_put(where, packed)

    return tuple(padded(v) for v in values) if return_entropy else padded(values)


def _check_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be "
            "B x T with T >= 2"
        )


def sampled_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                           samples: int, generator: torch.Generator, temperature: float = 1.0,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """At every position, ``samples`` tokens drawn (with replacement, by ``generator``) from
    the model's next-token distribution at ``temperature``, and their log-probs: two
    ``B x (T-1) x samples`` tensors, int64 and float32 (padding positions: meaningless).
    ``generator`` lives on the model's device.
    No gradient; left-padded rows are read as ``sequence_logprobs`` reads them."""
    _check_rows(input_ids, attention_mask)

    tokens = []  # the draws, beside the model output that carries their log-probs

    def draw(hidden, weight, bias):
        drawn, logprobs = _drawn_tokens(hidden, weight, bias, samples=samples, generator=generator,
                                        temperature=temperature, chunk_size=chunk_size)
        tokens.append(drawn)
        return logprobs

    with torch.no_grad():
        logprobs = _head_in_forward(model, _padded_inputs(input_ids, attention_mask), None, _flat_head(draw))
    return tokens[0].view(logprobs.shape), logprobs


def _drawn_tokens(hidden, weight, bias, *, samples, generator, temperature, chunk_size):
    """``samples`` tokens per row of ``hidden`` (``N x H``) drawn from the head's distribution,
    a chunk of positions at a time, and their log-probs: two ``N x samples`` tensors."""
    tokens, logprobs = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        log_p = _chunk_log_softmax(hidden[start : start + chunk_size], weight, bias, temperature)
        drawn = torch.multinomial(log_p.exp(), samples, replacement=True, generator=generator)
        tokens.append(drawn)
        logprobs.append(log_p.gather(-1, drawn))
    if not tokens:
        empty = hidden.new_zeros(0, samples)
        return empty.long(), empty.float()
    return torch.cat(tokens), torch.cat(logprobs)


def logprobs_of(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokens: torch.Tensor, *,
                temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """No-grad log-probs of ``tokens`` (``B x (T-1) x k``: k candidate next tokens per
    position, e.g. ``sampled_token_logprobs``' draws) under the model: ``B x (T-1) x k``."""
    _check_rows(input_ids, attention_mask)
    candidates = tokens.reshape(-1, tokens.shape[-1])

    def gather(hidden, weight, bias):
        return torch.cat([_chunk_log_softmax(hidden[start : start + chunk_size], weight, bias, temperature)
                          .gather(-1, candidates[start : start + chunk_size]) for start in range(0, hidden.shape[0], chunk_size)])

    with torch.no_grad():
        return _head_in_forward(model, _padded_inputs(input_ids, attention_mask), None, _flat_head(gather))


def _padded_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def _chunk_log_softmax(hidden, weight, bias, temperature):
    # The head runs in the model's dtype (as in generation); the softmax runs in float32.
    logits = F.linear(hidden, weight, bias).float()
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def _flat_head(compute):
    """A head function over ``(B, T-1, H)`` hidden states that runs ``compute`` on the
    flattened positions and restores the batch shape."""

    def head(hidden, weight, bias):
        values = compute(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
        return values.reshape(*hidden.shape[:-1], *values.shape[1:])

    return head


def _drawing_head(head, draw, select, slots, columns, temperature, chunk_size):
    """``head``, after ``draw`` has drawn at the hidden states ``select(hidden)`` picks."""

    def drawing(hidden, weight, bias):
        draw.fill(select(hidden), weight, bias, slots, columns, temperature, chunk_size)
        return head(hidden, weight, bias)

    return drawing


def _token_logprobs_head(targets, temperature, chunk_size, return_entropy):
    def head(hidden, weight, bias):
        scores = token_logprobs(hidden, weight, bias, targets, temperature=temperature, chunk_size=chunk_size,
                                return_entropy=return_entropy)
        return torch.stack(scores, dim=-1) if return_entropy else scores

    return head


def _head_in_forward(model, inputs, scored, head_function):
    """The model's forward on ``inputs`` with its output head replaced by
    ``head_function(hidden, weight, bias)`` of the hidden states at the positions ``scored``
    selects among ``hidden[:, :-1]`` (all when None); its result is the model's output.

    Hooks on ``model.get_output_embeddings()`` compute it inside the model's own forward
    from the head's input, while the head sees a single position. Running inside the
    forward keeps FSDP2's unsharded head weight valid and makes the result the model
    output, so FSDP2's pre-backward hook re-gathers the weight before backward.
    """
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("models with final_logit_softcapping are not supported: the head output is rescaled")
    head = model.get_output_embeddings()
    captured = {}

    def keep_one_position(module, args):
        captured["hidden"] = args[0]
        return (args[0][:, -1:],)

    def replace_logits(module, args, output):
        hidden = captured.pop("hidden")[:, :-1]
        return head_function(hidden if scored is None else hidden[0, scored], module.weight, module.bias)

    pre_handle = head.register_forward_pre_hook(keep_one_position)
    # prepend: run before FSDP2's post-forward hook reshards the head weight.
    post_handle = head.register_forward_hook(replace_logits, prepend=True)
    try:
        out = model(**inputs, use_cache=False)
    finally:
        pre_handle.remove()
        post_handle.remove()
    return out.logits
