"""Where a model that only scores or generates runs (learned reward models, judges): its
device and dtype, by the same defaults wherever one is built."""

from __future__ import annotations

import torch

INFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def inference_placement(device: str | torch.device | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """``device``, by default the current CUDA device where there is one, else the CPU; and
    ``dtype`` (a name of ``INFERENCE_DTYPES``), by default bfloat16 on a GPU and float32 on a
    CPU (whose bfloat16 matmuls are slow)."""
    if dtype is not None and dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(INFERENCE_DTYPES)} or None, got {dtype!r}")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return device, INFERENCE_DTYPES[dtype] if dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
