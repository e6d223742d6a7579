import importlib.util

import pytest
import torch

# The shared builders hold asserts too: pytest shows their values as it does in test files.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.models import byte_tokenizer, save_tied_qwen2, tiny_qwen2


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    no_vllm = pytest.mark.skip(reason="needs vLLM and a CUDA GPU; not installed here")
    has_vllm = importlib.util.find_spec("vllm") is not None
    integration = pytest.mark.integration
    for item in items:
        # The inner loop is `-m "not integration"`: every test that starts processes is one.
        if "integration" in item.path.parts or "distributed" in item.keywords:
            item.add_marker(integration)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "vllm" in item.keywords and not (has_vllm and torch.cuda.is_available()):
            item.add_marker(no_vllm)


@pytest.fixture
def no_alias_warned_yet(monkeypatch):
    """Deprecated names warn once per process: a test that expects the warning starts
    from none warned."""
    from lightning_logra.core import validation

    monkeypatch.setattr(validation, "_warned_aliases", set())


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory) -> str:
    """A tiny random Qwen2 and its byte-level tokenizer saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = byte_tokenizer(folder)
    model = tiny_qwen2(vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tied_folder(tmp_path_factory) -> str:
    """A tiny random Qwen2 whose head is its embedding (as SmolLM2's), with a byte tokenizer,
    saved as a Hugging Face folder."""
    return save_tied_qwen2(tmp_path_factory.mktemp("tied-qwen2"))
