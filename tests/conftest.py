import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    no_vllm = pytest.mark.skip(reason="needs vLLM and a CUDA GPU; not installed here")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "vllm" in item.keywords and not (has_vllm and torch.cuda.is_available()):
            item.add_marker(no_vllm)
