"""What one LoGRA step needs besides the sketches, as one object: the caller builds it and
hands it down with the step (``LoGRAOptimizer.step(logra_inputs=...)``; the same keyword
through Lightning's and Fabric's optimizers under ``logra_fsdp``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_logra.core.kl import LogprobPairs
from lightning_logra.core.probe import ProbeBatch


@dataclass(frozen=True)
class LoGRAStepInputs:
    """What one LoGRA step needs, beyond the sketches.

    ``probe``: the responses the KL probe scores (a ``ProbeBatch``, or its dict form); None
    under a ``logra_fsdp`` strategy probes the training batch when it is a dict with
    ``input_ids``. ``logprob_pairs``: rollout vs trainer log-probs for the mismatch term.
    ``normalization_tokens``: the global count of loss-bearing tokens when the loss is a
    sum over tokens (1 for a mean loss). ``record_low_rank``: keep the update as
    (alpha D, seed of A) per target on the ``StepReport``, for a low-rank weight sync.
    """

    probe: ProbeBatch | None = None
    logprob_pairs: LogprobPairs | None = None
    normalization_tokens: float = 1.0
    record_low_rank: bool = False

    def __post_init__(self) -> None:
        if self.probe is not None and not isinstance(self.probe, ProbeBatch):
            if not isinstance(self.probe, Mapping):
                raise TypeError(f"LoGRAStepInputs.probe must be a ProbeBatch or a mapping, got {type(self.probe).__name__}")
            object.__setattr__(self, "probe", ProbeBatch.from_mapping(self.probe))
        if self.logprob_pairs is not None and not isinstance(self.logprob_pairs, LogprobPairs):
            object.__setattr__(self, "logprob_pairs", LogprobPairs(*self.logprob_pairs))
        tokens = float(self.normalization_tokens)
        if not math.isfinite(tokens) or tokens <= 0:
            raise ValueError(f"LoGRAStepInputs.normalization_tokens = {self.normalization_tokens!r} must be a count > 0")
        if not isinstance(self.record_low_rank, bool):
            raise TypeError(f"LoGRAStepInputs.record_low_rank must be a bool, got {self.record_low_rank!r}")
