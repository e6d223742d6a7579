"""Bytes per rank of one whole RL training step, by part, from the model's shapes alone.

``memory_report`` (core) counts LoGRA's own state; this adds everything else a step holds on one
rank (GPU, or a CPU process), for dense AdamW, LoRA and LoGRA alike: the sharded float32
weights and what FSDP2 gathers, gradients, optimizer state, autocast's cached weight casts,
the activations of one micro-batch of ``tokens`` tokens (under activation checkpointing or
not) and its chunked log-prob logits, the KL reference model, the KL probe, and a share kept
for a colocated vLLM. The model may live on the ``meta`` device, so a 27B configuration is
predicted without any weights.

The activation counts are measured, not guessed: the bytes autograd saves per token of one
Qwen2/Llama decoder layer (counted with ``torch.autograd.graph.saved_tensors_hooks``,
parameters excluded, fitted over token counts, layer widths and depths; transformers 5.24,
torch 2.13) are ``32 h + 8 kv + 16 i`` in float32 and ``30 h + 4 kv + 8 i`` under bfloat16
autocast (the norms stay float32) when the weights are trained, and ``16 h + 8 kv + 12 i``
and ``12 h + 4 kv + 6 i`` when they are frozen (LoGRA, LoRA's base: no weight gradient needs
the layers' inputs), ``h`` the hidden width, ``kv`` the key/value width and ``i`` the MLP
width. LoRA's adapters and LoGRA's hooks under activation checkpointing save the targets'
inputs again (``3 h + i`` per token); LoRA's ``x A^T`` and LoGRA's ``X A^T`` add ``rank``
per target or projection group. A padding or packing mask adds one ``T x T`` tensor in the compute
dtype per layer (sdpa's own copy). What the counts leave out (allocator slack, the CUDA
context, NCCL buffers, fragmentation) is the caller's margin: ``fits`` takes it explicitly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.layout import rows_per_rank
from lightning_logra.core.memory import memory_report
from lightning_logra.core.projected_input import projection_groups
from lightning_logra.core.sketch import find_targets
from lightning_logra.rl.logprobs import DEFAULT_CHUNK_SIZE

METHODS = ("dense", "lora", "logra")
FLOAT32 = 4
# A checkpointed log-prob chunk, recomputed in backward: its logits, their float32 copy,
# log_softmax's saved output and the gradient flowing back through them.
LOGIT_COPIES = 4


@dataclass(frozen=True)
class StepSettings:
    """What the step is: the method, one micro-batch's tokens, the ranks and the dtypes.

    ``tokens``: tokens in one micro-batch (rows x length, or one packed row).
    ``masked``: the micro-batch carries an attention mask (padding or packing), which sdpa
    materialises as ``T x T`` per layer; ``T`` is ``row_tokens`` (default ``tokens``).
    ``compute_dtype``: float32, or bfloat16 for ``bf16-mixed`` (autocast over float32
    master weights, as the strategies run it). ``cpu_optimizer``: AdamW's single-tensor
    loop (CPU) instead of its multi-tensor one (GPU), which allocates one temporary as
    large as the whole sharded model. ``reference``: a KL reference model (``kl_coef > 0``,
    or ``logging.kl_from_init``), held in the compute dtype. ``vllm_bytes``: memory reserved for a colocated vLLM engine
    (``gpu_memory_utilization`` x the device). ``reward_model_bytes``: the weights of learned reward
    models on this device (``SequenceClassifierReward.weight_bytes()``; their activations are
    freed before training's forward). ``probe_tokens``: LoGRA's probe rows x their
    tokens (default: ``probe_responses`` x ``min(probe_max_tokens, row_tokens)``).
    """

    method: str
    tokens: int
    world_size: int = 1
    row_tokens: int | None = None
    masked: bool = True
    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = True
    logprob_chunk: int = DEFAULT_CHUNK_SIZE
    lora_rank: int = 256
    logra: LoGRAConfig | None = None
    reference: bool = False
    cpu_optimizer: bool = False
    vllm_bytes: int = 0
    reward_model_bytes: int = 0
    probe_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"StepSettings.method = {self.method!r}: choose one of {METHODS}")
        for name in ("tokens", "world_size", "logprob_chunk", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StepSettings.{name} = {value!r}: must be an integer >= 1")
        if self.compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"StepSettings.compute_dtype = {self.compute_dtype}: float32 or bfloat16")
        for name in ("vllm_bytes", "reward_model_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepSettings.{name} = {getattr(self, name)}: must be >= 0")


@dataclass(frozen=True)
class StepMemory:
    """Bytes per rank, by part; ``peak`` is the largest of the step's two phases:
    ``backward_peak`` (forward and backward of one micro-batch, the gradients or sketches
    of the whole batch accumulating) and ``update_peak`` (the optimizer step: AdamW's
    temporaries, or LoGRA's KL probe and update), both above what the step keeps
    throughout (``held``)."""

    weights: int  # the policy's float32 master weights (this rank's shard), LoRA adapters included
    gathered_weights: int  # FSDP2's unsharded blocks in flight and the unsharded root (world > 1)
    gradients: int
    optimizer_state: int  # AdamW's two moments (dense, LoRA); 0 for LoGRA
    logra_state: int  # memory_report(...).logra_state_bytes
    autocast_cache: int  # bf16 casts of trainable weights, cached by autocast for the step
    reference: int
    vllm: int
    reward_models: int
    activations: int  # one micro-batch's forward/backward, the log-prob logits included
    update_workspace: int  # AdamW's temporaries, or LoGRA's probe and update workspace
    held: int
    backward_peak: int
    update_peak: int
    peak: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def fits(self, device_bytes: int, margin_bytes: int = 0) -> bool:
        """Whether ``peak`` plus ``margin_bytes`` (allocator slack, CUDA context, NCCL)
        stays within ``device_bytes``."""
        return self.peak + margin_bytes <= device_bytes


@dataclass(frozen=True)
class DecoderShape:
    """The counts ``step_memory`` is built from, read off a Hugging Face decoder."""

    hidden: int
    intermediate: int
    layers: int
    kv_width: int
    kv_heads: int
    vocab: int
    block_parameters: int  # the largest decoder block's
    root_parameters: int  # everything outside the blocks (embeddings, output head, final norm)
    parameters: int
    linear_parameters: int  # weights and biases of every nn.Linear (what autocast casts)
    targets_per_block: int
    projected_inputs_per_block: int  # LoGRA's X A^T per block: one per projection group
    widest_target_rows: int  # the most rows of one target (LoGRA's update workspace)


def decoder_shape(model: nn.Module, target_modules, share_projection: bool) -> DecoderShape:
    config = getattr(model, "config", None)
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [name for name in needed if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"step_memory needs a Hugging Face decoder with config fields {needed}; "
                         f"{type(model).__name__} lacks {missing}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"step_memory cannot find the decoder blocks of {type(model).__name__} (no _no_split_modules)")
    parameters = sum(p.numel() for p in model.parameters())
    block_parameters = [sum(p.numel() for p in block.parameters()) for block in blocks]
    targets = find_targets(model, target_modules)
    groups = projection_groups(targets) if share_projection else targets
    return DecoderShape(hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
                  kv_width=kv_heads * head_dim, kv_heads=kv_heads, vocab=config.vocab_size, block_parameters=max(block_parameters),
                  root_parameters=parameters - sum(block_parameters), parameters=parameters,
                  linear_parameters=sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear)
                                        for p in m.parameters(recurse=False)),
                  targets_per_block=len(targets) // len(blocks), projected_inputs_per_block=len(groups) // len(blocks),
                  widest_target_rows=max(module.out_features for _, module in targets))


def layer_activation_bytes(shape: DecoderShape, tokens: int, row_tokens: int, *, masked: bool, dtype: torch.dtype,
                           trained_weights: bool = True, target_inputs: bool = False, rank: int = 0,
                           rank_wide_tensors: int = 0) -> int:
    """What autograd saves for one decoder layer over ``tokens`` tokens (module docstring):
    with its weights trained or frozen, plus the targets' inputs (``target_inputs``) and
    ``rank_wide_tensors`` tensors ``rank`` wide per token."""
    element = torch.empty((), dtype=dtype).element_size()
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    if dtype == torch.float32:
        per_token = 32 * h + 8 * kv + 16 * i if trained_weights else 16 * h + 8 * kv + 12 * i
    else:
        per_token = 30 * h + 4 * kv + 8 * i if trained_weights else 12 * h + 4 * kv + 6 * i
    if target_inputs:
        per_token += (3 * h + i) * element
    if masked and kv < h:
        # With a mask, sdpa gets keys and values repeated to every head, saved as copies
        # (measured: with a single key/value head the float32 repeat stays a view and the
        # bf16 one copies one of the two).
        copies = 2 if shape.kv_heads > 1 else int(dtype != torch.float32)
        per_token += copies * (h - kv) * element
    per_token += rank_wide_tensors * rank * element
    rows = max(1, tokens // row_tokens)
    mask = rows * row_tokens * row_tokens * element if masked else 0
    return tokens * per_token + mask


def step_memory(model: nn.Module, settings: StepSettings) -> StepMemory:
    """Bytes per rank of one RL step of ``model`` (real or on ``meta``) under ``settings``."""
    logra = settings.logra or LoGRAConfig()
    shape = decoder_shape(model, logra.target_modules, logra.share_projection_by_input)
    world, method = settings.world_size, settings.method
    element = torch.empty((), dtype=settings.compute_dtype).element_size()
    row_tokens = min(settings.row_tokens or settings.tokens, settings.tokens)

    def sharded(count: int) -> int:
        return rows_per_rank(count, world)

    adapters = 0
    if method == "lora":
        adapters = sum(settings.lora_rank * (module.in_features + module.out_features)
                       for _, module in find_targets(model, logra.target_modules))
    trainable = {"dense": shape.parameters, "lora": adapters, "logra": 0}[method]

    weights = (sharded(shape.parameters) + sharded(adapters)) * FLOAT32
    # FSDP2 gathers a block (and prefetches the next) in the master dtype: the strategies
    # run bf16 through autocast, not through FSDP2's mixed-precision policy. The root stays
    # unsharded from its forward to its backward.
    gathered = (2 * shape.block_parameters + shape.root_parameters) * FLOAT32 if world > 1 else 0
    gradients = sharded(trainable) * FLOAT32
    optimizer_state = 2 * sharded(trainable) * FLOAT32
    report = memory_report(model, logra, world_size=world, compute_dtype=settings.compute_dtype)
    logra_rank = report.rank
    logra_state = report.logra_state_bytes if method == "logra" else 0
    # Autocast caches its bf16 cast of every weight that requires grad until the region
    # exits, and the step's backward runs inside it: dense AdamW's Linear weights (the
    # output head included, the embedding lookup not) stay cast for the whole step,
    # unsharded; LoRA's adapters; none of LoGRA's frozen targets. Measured on CPU autocast
    # (156M Qwen2): leaving the region frees exactly 2 bytes per Linear parameter.
    cast = {"dense": shape.linear_parameters, "lora": adapters, "logra": 0}[method]
    autocast_cache = cast * 2 if settings.compute_dtype == torch.bfloat16 else 0
    reference = sharded(shape.parameters) * element if settings.reference else 0

    layer = layer_activation_bytes(shape, settings.tokens, row_tokens, masked=settings.masked,
                                   dtype=settings.compute_dtype,
                                   **_saved_by_method(method, settings, shape, logra_rank))
    residual = settings.tokens * shape.hidden * FLOAT32  # the float32 residual stream between layers
    logits = LOGIT_COPIES * min(settings.logprob_chunk, settings.tokens) * shape.vocab * FLOAT32
    if settings.activation_checkpointing:
        # Each layer's input is kept; backward recomputes one layer at a time.
        activations = shape.layers * residual + layer + logits
    else:
        activations = shape.layers * layer + logits

    if method == "logra":
        probe_tokens = settings.probe_tokens or logra.probe_rows() * min(logra.probe_max_tokens, row_tokens)
        update_workspace = _probe_bytes(shape, probe_tokens, logra.probe_mlp_chunk_tokens, settings)
        update_workspace += shape.widest_target_rows * logra_rank * FLOAT32  # one layer's update rows
        activations += report.projection_draw_bytes  # a regenerated A, drawn where it is used
    elif settings.cpu_optimizer:
        update_workspace = max(p.numel() for p in model.parameters() if p.dim() > 0) * FLOAT32 if trainable else 0
    else:
        update_workspace = sharded(trainable) * FLOAT32

    held = weights + optimizer_state + logra_state + reference + settings.vllm_bytes + settings.reward_model_bytes
    backward_peak = gathered + gradients + autocast_cache + activations
    update_peak = gradients + update_workspace
    return StepMemory(weights=weights, gathered_weights=gathered, gradients=gradients, optimizer_state=optimizer_state,
                      logra_state=logra_state, autocast_cache=autocast_cache, reference=reference,
                      vllm=settings.vllm_bytes, reward_models=settings.reward_model_bytes, activations=activations, update_workspace=update_workspace, held=held,
                      backward_peak=held + backward_peak, update_peak=held + update_peak,
                      peak=held + max(backward_peak, update_peak))


def _saved_by_method(method: str, settings: StepSettings, shape: DecoderShape, logra_rank: int) -> dict:
    """What ``method`` changes in a layer's saved tensors: frozen weights (LoRA's base and
    LoGRA's targets), the targets' inputs saved again (LoRA's adapters; LoGRA's hooks under
    checkpointing), and the rank-wide products (LoRA per target; LoGRA per projection group,
    kept from the forward when nothing is recomputed, else made in backward one at a time)."""
    if method == "lora":
        return {"trained_weights": False, "target_inputs": True, "rank": settings.lora_rank,
                "rank_wide_tensors": shape.targets_per_block}
    if method == "logra":
        if settings.activation_checkpointing:
            return {"trained_weights": False, "target_inputs": True, "rank": logra_rank, "rank_wide_tensors": 1}
        return {"trained_weights": False, "rank": logra_rank, "rank_wide_tensors": shape.projected_inputs_per_block}
    return {}


def _probe_bytes(shape: DecoderShape, tokens: int, mlp_chunk: int, settings: StepSettings) -> int:
    """LoGRA's KL probe: a forward with tangents (forward-mode AD), no grad, so only one
    layer's primals and tangents are live: the attention part over all probe tokens, the
    MLP in chunks of ``probe_mlp_chunk_tokens``, the residual stream, a log-prob chunk."""
    element = torch.empty((), dtype=settings.compute_dtype).element_size()
    attention = tokens * 2 * (4 * shape.hidden + 2 * shape.kv_width) * element
    mlp = min(mlp_chunk, tokens) * 2 * 3 * shape.intermediate * element
    residual = tokens * 2 * shape.hidden * FLOAT32
    logits = 2 * min(settings.logprob_chunk, tokens) * shape.vocab * FLOAT32
    return attention + mlp + residual + logits
