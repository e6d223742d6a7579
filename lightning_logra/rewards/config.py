"""The reward functions ``GRPOModule`` scores rollouts with, as a dataclass that YAML configs
fill in (``model.init_args.reward``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_logra.core.validation import FieldChecks, is_finite_number

DEFAULT_REWARD = "lightning_logra.rewards.math:math_reward"


@dataclass
class RewardConfig:
    """Reward functions, each TRL's ``fn(completions, **columns) -> list[float | None]``,
    weighted and summed per sample by a ``RewardRunner``, which isolates their failures and
    timeouts."""

    functions: list[str | Callable] = field(default_factory=lambda: [DEFAULT_REWARD])
    """Import paths ``"module:function"`` (in Python, callables too), or, as TRL takes them, learned reward models:
    a string without ``:`` is a Hugging Face folder (that exists) or hub id ``org/name`` of a one-label
    ``AutoModelForSequenceClassification``
    (``rewards.models.SequenceClassifierReward``); default: the built-in math reward."""
    weights: list[float] | None = None
    """One weight per function; None: 1 each."""
    timeout_s: float = 10.0
    """Seconds each function may take on a batch, at most 86400 (24 h); past it the
    function's scores for the batch are failures (0, counted)."""
    max_consecutive_timeouts: int = 3
    """Batches in a row on which one function may time out before the run stops with an error
    naming it (each timeout of a function run in a thread leaves that thread behind)."""
    model_device: str | None = None
    """The device of the learned reward models; None: the current CUDA device where there is one, else the CPU."""
    model_dtype: str | None = None
    """Their dtype, ``float32``, ``bfloat16`` or ``float16``; None: bfloat16 on a GPU, float32 on a CPU."""
    model_batch_size: int = 16
    """Texts a reward model scores per forward."""
    model_max_length: int | None = None
    """Tokens a reward model reads of each text at most (the rest is cut); None: all."""

    def model_options(self) -> dict:
        return {"device": self.model_device, "dtype": self.model_dtype, "batch_size": self.model_batch_size,
                "max_length": self.model_max_length}

    def __post_init__(self) -> None:
        check = FieldChecks.of(self)
        functions = self.functions
        check.require("functions", isinstance(functions, (list, tuple)) and len(functions) > 0
                      and all((isinstance(f, str) and f) or callable(f) for f in functions),
                      "a non-empty list of import paths 'module:function', reward model folders or hub ids "
                      "(or callables)")
        count = len(functions)
        check.require("weights", self.weights is None or (
            isinstance(self.weights, (list, tuple)) and len(self.weights) == count
            and all(is_finite_number(weight) for weight in self.weights)),
            f"None or a list of finite numbers, one per function ({count})")
        check.timeout("timeout_s")
        check.integer("max_consecutive_timeouts", at_least=1)
        check.choice("model_dtype", ("float32", "bfloat16", "float16", None))
        check.integer("model_batch_size", at_least=1)
        check.integer("model_max_length", at_least=1, optional=True)


# A plain dataclass, safe to rebuild: checkpoints that hold it as a hyper-parameter load under
# torch.load's default weights_only=True, as Lightning passes it.
torch.serialization.add_safe_globals([RewardConfig])
