"""How the KL probe runs the model's own modules under forward-mode AD, in bounded memory.

Forward AD keeps a primal and a tangent of every activation, so the probe's largest
temporaries are those of its widest modules at a row's full length. SDPA attention runs
as the fused kernel with its tangent written out in blocks of queries, linear layers as
two plain GEMMs (``_ProbeFunctions``), and position-wise MLPs (a module with ``down_proj`` and
``gate_proj`` or ``up_proj`` children, as in Llama, Qwen and Mistral) run over the tokens in
chunks, so their (tokens x intermediate) activations and tangents exist for one chunk at a
time. Each token's MLP output depends on that token alone: chunking changes no value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

def chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


class _ProbeFunctions(TorchFunctionMode):
    """The two functions whose forward-mode derivatives the probe writes itself.

    ``F.scaled_dot_product_attention``: the value from the fused kernel, the tangent
    computed by hand in blocks of ``block`` queries, so a (block x keys) score matrix is the
    largest it makes (``_AttentionWithTangent``). Same semantics as SDPA: boolean masks keep
    True, float masks are added, ``is_causal`` is aligned top-left, grouped-query attention
    with ``enable_gqa``; a query that may attend to nothing gets a zero output and tangent
    rather than NaN, so a masked padding position cannot poison the tangents of the
    positions that follow it.

    ``F.linear`` of a dual input by a weight without a tangent: ``_linear_with_tangent``.
    """

    def __init__(self, block: int):
        super().__init__()
        self.block = block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is F.linear:
            return _linear_with_tangent(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p != 0.0:
            raise ValueError("the KL probe runs the model in eval mode; attention dropout must be 0")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return _AttentionWithTangent.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, self.block)


def _linear_with_tangent(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose tangent, when only the input has one, is one more GEMM: the
    weight's. Forward AD's own rule for the matmul also multiplies the input by the weight's
    zero tangent, written out in full (a third GEMM and a copy of the weight): a third of the
    probe's time at Qwen2.5-7B's widths. Same values: the skipped term is exactly zero."""
    primal, tangent = fwAD.unpack_dual(input)
    if tangent is None or any(fwAD.unpack_dual(t).tangent is not None for t in (weight, bias) if t is not None):
        return F.linear(input, weight, bias)
    return fwAD.make_dual(F.linear(primal, weight, bias), F.linear(tangent, weight))


class _AttentionWithTangent(torch.autograd.Function):
    """SDPA whose forward-mode tangent is written out: with S = scale * Q K^T (+ mask) and
    P = softmax(S), d(P V) = P dV + (P * dS) V - rowsum(P * dS) * (P V), where
    dS = scale * (dQ K^T + Q dK^T). About twice as fast as letting forward AD trace the
    same blocked computation op by op, and the value keeps the fused kernel."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, block):
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                                scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            output = torch.where(attn_mask.any(dim=-1, keepdim=True), output, torch.zeros_like(output))
        ctx.save_for_forward(query, key, value, output)
        ctx.attn_mask, ctx.is_causal, ctx.scale, ctx.block = attn_mask, is_causal, scale, block
        return output

    @staticmethod
    def jvp(ctx, query_t, key_t, value_t, *_):
        query, key, value, output = ctx.saved_tensors
        query_t, key_t, value_t = (torch.zeros_like(x) if t is None else t for x, t in ((query, query_t), (key, key_t), (value, value_t)))
        groups = query.shape[-3] // key.shape[-3]
        if groups > 1:
            key, value, key_t, value_t = (x.repeat_interleave(groups, dim=-3) for x in (key, value, key_t, value_t))
        # dS = scale * [Q, dQ] [dK, K]^T: one matmul of twice the depth instead of two and a sum.
        keys_for_score_t = torch.cat([key_t, key], dim=-1).transpose(-2, -1)
        key_transposed = key.transpose(-2, -1)
        attn_mask, scale = ctx.attn_mask, ctx.scale
        batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        # The three (block x keys) matrices of every block live in one workspace: on CPU a
        # fresh tensor that large is a fresh mapping whose page faults cost about as much
        # as the block's arithmetic.
        workspace = query.new_empty(3, batch.numel() * min(ctx.block, query.shape[-2]) * key.shape[-2])
        blocks = []
        for rows in chunks(query.shape[-2], ctx.block):
            # Under is_causal, keys after the block's last query are never attended: skip them.
            keys = slice(0, min(rows.stop, key.shape[-2])) if ctx.is_causal else slice(0, key.shape[-2])
            shape = (*batch, rows.stop - rows.start, keys.stop)
            scores, weights, weighted_score_t = (part[: math.prod(shape)].view(shape) for part in workspace)
            query_rows = query[..., rows, :] * scale  # scaling the block's queries, not its scores
            torch.matmul(query_rows, key_transposed[..., keys], out=scores)
            if ctx.is_causal:  # only the keys from the block's first query on can be in the future
                future = torch.ones(rows.stop - rows.start, scores.shape[-1] - rows.start, dtype=torch.bool,
                                    device=query.device).triu_(1)
                scores[..., rows.start:].masked_fill_(future, float("-inf"))
            if attn_mask is not None:
                mask = attn_mask[..., rows, keys] if attn_mask.shape[-2] > 1 else attn_mask[..., keys]
                if mask.dtype == torch.bool:
                    scores.masked_fill_(~mask, float("-inf"))
                else:
                    scores.add_(mask)
            torch.softmax(scores, dim=-1, out=weights)
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                torch.nan_to_num_(weights, nan=0.0)  # a query that sees nothing
            torch.matmul(torch.cat([query_rows, query_t[..., rows, :] * scale], dim=-1), keys_for_score_t[..., keys],
                         out=weighted_score_t).mul_(weights)
            tangent = weights @ value_t[..., keys, :]
            tangent.add_(weighted_score_t @ value[..., keys, :])
            tangent.sub_(weighted_score_t.sum(dim=-1, keepdim=True) * output[..., rows, :])
            blocks.append(tangent)
        return torch.cat(blocks, dim=-2)


@contextmanager
def eval_mode(model: nn.Module):
    """Eval mode, every module's train/eval flag restored afterwards, even on error."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training


def position_wise_mlps(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that the probe may run token chunk by token chunk."""
    return [module for module in model.modules()
            if hasattr(module, "down_proj") and (hasattr(module, "gate_proj") or hasattr(module, "up_proj"))]


@contextmanager
def _mlps_in_token_chunks(model: nn.Module, tokens: int):
    """Each position-wise MLP's forward over ``tokens`` positions at a time (dim -2 of its
    input); the original forwards are restored afterwards, even on error."""
    patched = []

    def chunked(forward):
        def run(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if hidden.dim() < 2 or hidden.shape[-2] <= tokens:
                return forward(hidden, *args, **kwargs)
            # Contiguous, so each projection folds into one GEMM rather than a batched one
            # over a copy of its weight per row of the batch.
            return torch.cat([forward(hidden[..., rows, :].contiguous(), *args, **kwargs)
                              for rows in chunks(hidden.shape[-2], tokens)], dim=-2)

        return run

    try:
        for module in position_wise_mlps(model):
            had_own = "forward" in module.__dict__
            patched.append((module, had_own, module.__dict__.get("forward")))
            module.forward = chunked(module.forward)
        yield
    finally:
        for module, had_own, own in patched:
            if had_own:
                module.forward = own
            else:
                del module.forward


@contextmanager
def probe_mode(model: nn.Module, attention_block: int, mlp_chunk: int):
    """Eval mode, no grad, blocked SDPA attention that supports forward AD, and MLPs in
    chunks of ``mlp_chunk`` tokens; the model's attention implementation and forwards are
    restored afterwards, even on error."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    switch = attention not in (None, "eager", "sdpa") and hasattr(model, "set_attn_implementation")
    try:
        if switch:
            model.set_attn_implementation("sdpa")
        with eval_mode(model), torch.no_grad(), _ProbeFunctions(attention_block), _mlps_in_token_chunks(model, mlp_chunk):
            yield
    finally:
        if switch:
            model.set_attn_implementation(attention)
