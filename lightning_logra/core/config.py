"""LoGRA hyper-parameters: one validated dataclass with the paper's defaults."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal

DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# Fields that define the sketches and projections themselves. A checkpoint written with
# different values cannot be resumed: its row moments and update counter would describe
# other random projections. A field missing from a checkpoint's configuration (one written
# before the field existed) counts as its default.
STRUCTURAL_FIELDS: tuple[str, ...] = (
    "rank",
    "seed",
    "distribution",
    "refresh",
    "target_modules",
    "share_projection_by_input",
)

# ``rank: auto`` resolves against the model's targets (``projection.auto_rank``).
AUTO_RANK = "auto"


@dataclass
class LoGRAConfig:
    """Every LoGRA knob, with the defaults of the paper (section numbers of the spec).

    Invalid values raise ``ValueError`` naming the field and its allowed range.
    """

    # section 2: projections. rank "auto" (ours) picks a power of 4 from the targets' input
    # widths when the sketches are installed (projection.auto_rank); LoGRAOptimizer then
    # writes the resolved int back into this field, and that int is what checkpoints hold.
    rank: int | Literal["auto"] = 256
    seed: int = 42
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    refresh: bool = True
    # (ours) q/k/v of one attention block, and gate/up of one MLP, read the same input: with
    # this on they share one projection A, so X A^T is computed once per group (sketch.py).
    share_projection_by_input: bool = False
    # section 1: which weights
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    # section 5: RowAdam
    beta2: float = 0.95
    epsilon: float = 1e-8
    # section 6: global step size. Constant, as in the reference (the KL budget schedule is
    # LoGRA's schedule); true scales it by the user's lr / initial lr (Lightning strategies).
    update_ratio: float = 6e-5
    follow_lr_schedule: bool = False
    # section 7: predicted-KL controller. kl_control=false steps unscaled (alpha = 1).
    kl_control: bool = True
    kl_budget: float = 2e-4
    kl_budget_final: float = 2e-5
    schedule_steps: int = 300
    alpha_max: float = 3.0
    temperature: float | None = None  # None: the probe batch's sampling temperature
    probe_responses: int = 2
    probe_max_tokens: int = 4096
    probe_position_chunk: int = 128  # attention queries / scored positions per block in the probe
    probe_mlp_chunk: int = 512  # (ours) tokens per chunk of the probe's position-wise MLPs: their activations' memory
    mismatch_subtraction: bool = True
    mismatch_ema_weight: float = 0.3
    mismatch_budget_floor: float = 0.5
    update_factor_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # layout (beyond the reference): "auto" reduce-scatters sketches by weight rows when
    # the weights are row-sharded over more than one rank, else all-reduces them.
    sketch_reduction: Literal["auto", "all_reduce", "reduce_scatter"] = "auto"
    # (ours) under the reduce-scatter layout, "sharded" reduce-scatters each layer's
    # contribution in backward, per micro-batch, so a rank accumulates only its own rows;
    # "local" accumulates every row and reduces once per step (fewer collectives when
    # there are many micro-batches). "auto": sharded whenever sketches are reduce-scattered.
    sketch_accumulation: Literal["auto", "sharded", "local"] = "auto"
    row_chunk: int = 256
    # reliability: a non-finite sketch, predicted KL or step scale skips the step (no
    # weight touched) or raises; too many skips in a row stop the run
    on_nonfinite: Literal["skip", "raise"] = "skip"
    max_consecutive_skips: int = 3

    def __post_init__(self) -> None:
        self.target_modules = list(self.target_modules)
        self.validate()

    def validate(self) -> None:
        _require(
            self,
            "rank",
            self.rank == AUTO_RANK or (_integer(self.rank) and self.rank >= 1),
            f"an integer >= 1 or {AUTO_RANK!r}",
        )
        _require(self, "seed", isinstance(self.seed, int) and self.seed >= 0, "an integer >= 0")
        _choice(self, "distribution", ("rademacher", "gaussian"))
        _require(self, "refresh", isinstance(self.refresh, bool), "true or false")
        _require(self, "share_projection_by_input", isinstance(self.share_projection_by_input, bool), "true or false")
        _require(
            self,
            "target_modules",
            len(self.target_modules) > 0
            and all(isinstance(t, str) and t and "." not in t for t in self.target_modules),
            "a non-empty list of module names (last name component, e.g. 'q_proj')",
        )
        _open_unit(self, "beta2")
        _positive(self, "epsilon")
        _positive(self, "update_ratio")
        _positive(self, "kl_budget")
        _positive(self, "kl_budget_final")
        _require(
            self,
            "schedule_steps",
            isinstance(self.schedule_steps, int) and self.schedule_steps >= 1,
            "an integer >= 1",
        )
        _require(self, "alpha_max", _finite(self.alpha_max) and self.alpha_max >= 1.0, ">= 1")
        _require(self, "follow_lr_schedule", isinstance(self.follow_lr_schedule, bool), "true or false")
        _require(self, "kl_control", isinstance(self.kl_control, bool), "true or false")
        if self.temperature is not None:
            _positive(self, "temperature")
        _require(
            self,
            "probe_responses",
            isinstance(self.probe_responses, int) and self.probe_responses >= 1,
            "an integer >= 1",
        )
        _require(
            self,
            "probe_max_tokens",
            isinstance(self.probe_max_tokens, int) and self.probe_max_tokens >= 1,
            "an integer >= 1",
        )
        _require(
            self,
            "probe_position_chunk",
            isinstance(self.probe_position_chunk, int) and self.probe_position_chunk >= 1,
            "an integer >= 1",
        )
        _require(
            self,
            "probe_mlp_chunk",
            isinstance(self.probe_mlp_chunk, int) and self.probe_mlp_chunk >= 1,
            "an integer >= 1",
        )
        _require(self, "mismatch_subtraction", isinstance(self.mismatch_subtraction, bool), "true or false")
        _require(
            self,
            "mismatch_ema_weight",
            _finite(self.mismatch_ema_weight) and 0.0 < self.mismatch_ema_weight <= 1.0,
            "in (0, 1]",
        )
        _require(
            self,
            "mismatch_budget_floor",
            _finite(self.mismatch_budget_floor) and 0.0 < self.mismatch_budget_floor <= 1.0,
            "in (0, 1]",
        )
        _choice(self, "update_factor_dtype", ("bfloat16", "float32"))
        _choice(self, "sketch_reduction", ("auto", "all_reduce", "reduce_scatter"))
        _choice(self, "sketch_accumulation", ("auto", "sharded", "local"))
        _require(
            self,
            "sketch_accumulation",
            not (self.sketch_accumulation == "sharded" and self.sketch_reduction == "all_reduce"),
            "'local' or 'auto' with sketch_reduction='all_reduce' (every rank then needs every row)",
        )
        _require(self, "row_chunk", isinstance(self.row_chunk, int) and self.row_chunk >= 1, "an integer >= 1")
        _choice(self, "on_nonfinite", ("skip", "raise"))
        _require(
            self,
            "max_consecutive_skips",
            isinstance(self.max_consecutive_skips, int) and self.max_consecutive_skips >= 1,
            "an integer >= 1",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoGRAConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"LoGRAConfig: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def structural_mismatches(self, other: dict[str, Any]) -> list[str]:
        """``"field: saved != mine"`` for every field in STRUCTURAL_FIELDS whose value differs
        from ``other``; a field ``other`` lacks counts as its default.

        A rank of ``"auto"`` is compared as written: compare the resolved configuration
        (``LoGRAOptimizer.config`` after construction holds the int in use)."""
        mine = self.to_dict()
        defaults = _defaults()
        saved = {name: other.get(name, defaults[name]) for name in STRUCTURAL_FIELDS}
        return [f"{name}: {saved[name]!r} != {mine[name]!r}" for name in STRUCTURAL_FIELDS if saved[name] != mine[name]]

    def tuning_changes(self, other: dict[str, Any]) -> list[str]:
        """``"field: old -> new"`` for every non-structural field whose value differs from
        ``other`` (the configuration a checkpoint was written with)."""
        mine = self.to_dict()
        return [
            f"{name}: {other[name]!r} -> {mine[name]!r}"
            for name in mine
            if name not in STRUCTURAL_FIELDS and name in other and other[name] != mine[name]
        ]


def _defaults() -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(LoGRAConfig)}


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(config: LoGRAConfig, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LoGRAConfig.{name} = {getattr(config, name)!r} is invalid: must be {allowed}")


def _choice(config: LoGRAConfig, name: str, allowed: tuple[str, ...]) -> None:
    _require(config, name, getattr(config, name) in allowed, "one of " + ", ".join(repr(a) for a in allowed))


def _positive(config: LoGRAConfig, name: str) -> None:
    value = getattr(config, name)
    _require(config, name, _finite(value) and value > 0, "a finite number > 0")


def _open_unit(config: LoGRAConfig, name: str) -> None:
    value = getattr(config, name)
    _require(config, name, _finite(value) and 0.0 < value < 1.0, "in (0, 1)")
