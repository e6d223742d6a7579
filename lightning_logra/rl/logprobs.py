"""Per-token log-probabilities without materialising full-vocabulary logits.

The LM head turns a few thousand positions into vocab-sized float32 rows; for a 150k
vocabulary that is the largest tensor of an RL step. ``token_logprobs`` computes the
head in chunks of positions and checkpoints each chunk, so at most one chunk of logits
exists at a time, in forward and in backward (which recomputes the chunk's logits).
"""

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
    # The head runs in the model's dtype (as in generation); the softmax runs in float32.
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1) if with_entropy else None
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token of a Hugging Face causal LM: ``out[:, t] = log p(ids[:, t+1] | ids[:, :t+1])``.

    Returns float32 ``B x (T-1)`` (and the entropies with ``return_entropy``). Position ids
    follow the attention mask, as in ``generate``, so left-padded rows score exactly as
    they were sampled. Values at padding positions are meaningless: mask them.
    """
    _check_rows(input_ids, attention_mask)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return _logprobs_in_forward(model, inputs, None, input_ids[:, 1:], temperature=temperature,
                                chunk_size=chunk_size, return_entropy=return_entropy)


def packed_sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logprobs`` of the same padded rows, computed as one packed row of their
    real tokens: no padding position runs through the model or its head.

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
    values = _logprobs_in_forward(model, inputs, scored, packed_ids[0, 1:][scored], temperature=temperature,
                                  chunk_size=chunk_size, return_entropy=return_entropy)
    where = (rows[:-1][scored], columns[:-1][scored])

    def padded(packed: torch.Tensor) -> torch.Tensor:
        return packed.new_zeros(input_ids.shape[0], input_ids.shape[1] - 1).index_put(where, packed)

    return tuple(padded(v) for v in values) if return_entropy else padded(values)


def _check_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be "
            "B x T with T >= 2"
        )


def _logprobs_in_forward(model, inputs, scored, targets, *, temperature, chunk_size, return_entropy):
    """The model's forward on ``inputs`` with the head replaced by ``token_logprobs`` of
    ``targets`` at the positions ``scored`` selects among ``hidden[:, :-1]`` (all when None).

    Hooks on ``model.get_output_embeddings()`` compute the log-probs inside the model's
    own forward from the head's input, while the head sees a single position. Running
    inside the forward keeps FSDP2's unsharded head weight valid and makes the result the
    model output, so FSDP2's pre-backward hook re-gathers the weight before backward.
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
        scores = token_logprobs(
            hidden if scored is None else hidden[0, scored],
            module.weight,
            module.bias,
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=return_entropy,
        )
        return torch.stack(scores, dim=-1) if return_entropy else scores

    pre_handle = head.register_forward_pre_hook(keep_one_position)
    # prepend: run before FSDP2's post-forward hook reshards the head weight.
    post_handle = head.register_forward_hook(replace_logits, prepend=True)
    try:
        out = model(**inputs, use_cache=False)
    finally:
        pre_handle.remove()
        post_handle.remove()
    if return_entropy:
        return out.logits[..., 0], out.logits[..., 1]
    return out.logits
