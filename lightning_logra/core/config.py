"""LoGRA hyper-parameters: one validated dataclass with the paper's defaults."""

from __future__ import annotations

from dataclasses import MISSING, InitVar, asdict, dataclass, field, fields
from typing import Any, Literal

from lightning_logra.core.validation import FieldChecks, deprecated_attributes, is_integer, renamed_field

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
    "redraw_projections",
    "target_modules",
    "share_projection_by_input",
)

# Renamed fields: deprecated name -> today's name. The old names are still accepted as
# keyword arguments and YAML keys (they warn once per name per process), and a checkpoint's
# saved configuration written under them is read under the new ones (``saved_config``).
DEPRECATED_ALIASES: dict[str, str] = {
    "temperature": "probe_temperature",
    "refresh": "redraw_projections",
    "row_chunk": "update_chunk_rows",
    "probe_position_chunk": "probe_chunk_positions",
    "probe_mlp_chunk": "probe_mlp_chunk_tokens",
}

# Responses per rank the KL probe scores by default: the authors' 2 first ones, or one from
# each of 8 strata (issue 41: the quickstart's per-row step KL, benchmarks/results/step_kl_rows.md).
REFERENCE_PROBE_RESPONSES = 2
DRAWN_PROBE_RESPONSES = 8

# ``rank: auto`` resolves against the model's targets (``projection.auto_rank``).
AUTO_RANK = "auto"


@deprecated_attributes(DEPRECATED_ALIASES)
@dataclass
class LoGRAConfig:
    """Every LoGRA knob, with the defaults of the paper (section numbers of the spec).

    Invalid values raise ``ValueError`` naming the field and its allowed range. Renamed
    fields keep their old names (``DEPRECATED_ALIASES``) as deprecated keyword arguments
    and YAML keys, which warn once; a checkpoint's saved configuration is read under the
    new names.
    """

    # section 2: projections
    rank: int | Literal["auto"] = 256
    """Rank r of the projections A (r x input width). ``"auto"`` (ours) picks a power of 4
    from the targets' input widths when the sketches are installed (``projection.auto_rank``);
    ``LoGRAOptimizer`` then writes the resolved int back here, and that int is what
    checkpoints hold."""
    seed: int = 42
    """Base seed of the projections, from 0 to 2**63 - 1: every A is re-derived from it, the
    update number and the layer's name."""
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    """Entries of A: +-1/sqrt(r) (random signs), or N(0, 1)/sqrt(r)."""
    redraw_projections: bool = True
    """Draw a new A for every target after every update (the paper); false keeps the first
    one for the whole run."""
    share_projection_by_input: bool = False
    """(ours) q/k/v of one attention block, and gate/up of one MLP, read the same input: with
    this on they share one projection A, so X A^T is computed once per group."""
    regenerate_projections: bool = False
    """(ours) Keep no A between uses: draw it again from its seed wherever it is used (the
    forward or backward of each micro-batch, the KL probe, the update), the same bits, so
    the updates are those of stored projections exactly. Saves the projections' memory
    (``memory_report``'s ``projections``) for a draw of each A per use. Rademacher only."""
    # section 1: which weights
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Last name components of the linear layers LoGRA trains (e.g. ``q_proj``)."""
    # section 5: RowAdam
    beta2: float = 0.95
    """Decay of the per-row second moment, in (0, 1)."""
    epsilon: float = 1e-8
    """Relative epsilon: each row's RMS gets ``epsilon`` times the layer's mean row RMS added."""
    # section 6: global step size
    update_ratio: float = 6e-5
    """Size of the proposed update before the KL controller scales it: ||D A||_F is
    ``update_ratio`` times the norm of all target weights. Constant, as in the reference
    (the KL budget schedule is LoGRA's schedule)."""
    follow_lr_schedule: bool = False
    """Scale ``update_ratio`` by the user's lr / initial lr (Lightning strategies)."""
    # section 7: predicted-KL controller
    kl_control: bool = True
    """Scale each update to the KL budget; false steps unscaled (alpha = 1)."""
    kl_budget: float = 2e-4
    """Predicted KL allowed per update at the start of the schedule."""
    kl_budget_final: float = 2e-5
    """Budget at the end of the cosine schedule."""
    schedule_steps: int = 300
    """Updates over which the budget goes from ``kl_budget`` to ``kl_budget_final``."""
    alpha_max: float = 3.0
    """Largest step scale the controller may apply, >= 1."""
    probe_temperature: float | None = None
    """Temperature of the KL probe's softmax; None: the probe batch's sampling temperature."""
    kl_probe: Literal["weighted", "stratified", "reference"] = "weighted"
    """(ours) Which responses the KL probe scores. ``weighted``: the update's responses
    sorted by their key (GRPO: the advantage) are cut into ``probe_responses`` strata of
    about equal expected KL (tokens times ``1 + key^2 / mean key^2``), a response holding a
    stratum's share is probed for certain (a rare outcome's, which moves most), one is drawn
    from each other stratum and weighted by its stratum's share, so the prediction estimates
    the step's KL over every trained token; ``stratified`` (the default until 2026-12-07):
    strata of about equal tokens; ``reference``: the first ``probe_responses`` (the
    authors'; they under-estimate the batch's KL when a few responses carry most of it)."""
    probe_responses: int | None = None
    """Responses per rank the KL probe runs on; None: 2 with ``kl_probe: reference`` (the
    authors'), 8 with ``stratified`` and ``weighted``."""
    probe_max_tokens: int = 4096
    """Most real tokens per probe response."""
    probe_chunk_positions: int = 128
    """Attention queries and scored positions per block in the probe: bounds its score
    blocks and full-vocabulary logits."""
    probe_mlp_chunk_tokens: int = 512
    """(ours) Tokens per chunk of the probe's position-wise MLPs: bounds their activations."""
    mismatch_subtraction: bool = True
    """Subtract the rollout/trainer log-prob mismatch (an EMA) from the budget."""
    mismatch_ema_weight: float = 0.3
    """Weight of a new observation in the mismatch EMA, in (0, 1]."""
    mismatch_budget_floor: float = 0.5
    """The mismatch never lowers the budget below this fraction of it, in (0, 1]."""
    update_factor_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """``alpha * D`` is rounded through this dtype before ``W -= (alpha D) A``."""
    # layout (beyond the reference)
    sketch_reduction: Literal["auto", "all_reduce", "reduce_scatter"] = "auto"
    """How sketches are reduced across ranks. ``"auto"``: reduce-scattered by weight rows
    when the weights are row-sharded over more than one rank, else all-reduced."""
    sketch_accumulation: Literal["auto", "sharded", "local"] = "auto"
    """(ours) Under the reduce-scatter layout, ``"sharded"`` reduce-scatters each layer's
    contribution in backward, per micro-batch, so a rank accumulates only its own rows;
    ``"local"`` accumulates every row and reduces once per step (fewer collectives with many
    micro-batches). ``"auto"``: sharded whenever sketches are reduce-scattered."""
    update_chunk_rows: int = 256
    """Weight rows updated at a time by ``W -= (alpha D) A``: bounds the update's workspace."""
    # reliability
    on_nonfinite: Literal["skip", "raise"] = "skip"
    """A non-finite sketch, predicted KL or step scale skips the step (no weight touched)
    or raises."""
    max_consecutive_skips: int = 3
    """Skipped steps in a row that stop the run."""

    # Deprecated names (DEPRECATED_ALIASES): keyword arguments and YAML keys, None meaning not
    # given; as attributes they read and write the new fields (deprecated_attributes). Never
    # in to_dict(), repr or comparisons.
    temperature: InitVar[float | None] = None
    """Deprecated: use ``probe_temperature``."""
    refresh: InitVar[bool | None] = None
    """Deprecated: use ``redraw_projections``."""
    row_chunk: InitVar[int | None] = None
    """Deprecated: use ``update_chunk_rows``."""
    probe_position_chunk: InitVar[int | None] = None
    """Deprecated: use ``probe_chunk_positions``."""
    probe_mlp_chunk: InitVar[int | None] = None
    """Deprecated: use ``probe_mlp_chunk_tokens``."""

    def __post_init__(self, temperature: float | None, refresh: bool | None, row_chunk: int | None,
                      probe_position_chunk: int | None, probe_mlp_chunk: int | None) -> None:
        given = {"temperature": temperature, "refresh": refresh, "row_chunk": row_chunk,
                 "probe_position_chunk": probe_position_chunk, "probe_mlp_chunk": probe_mlp_chunk}
        defaults = _defaults()
        for old, new in DEPRECATED_ALIASES.items():
            setattr(self, new, renamed_field("LoGRAConfig", old, new, given[old], getattr(self, new), defaults[new]))
        if isinstance(self.target_modules, (list, tuple)):
            self.target_modules = list(self.target_modules)
        self.validate()

    def validate(self) -> None:
        check = FieldChecks.of(self)
        check.require("rank", self.rank == AUTO_RANK or (is_integer(self.rank) and self.rank >= 1),
                      f"an integer >= 1 or {AUTO_RANK!r}")
        check.seed("seed")
        check.choice("distribution", ("rademacher", "gaussian"))
        check.boolean("redraw_projections")
        check.boolean("share_projection_by_input")
        check.boolean("regenerate_projections")
        check.require("regenerate_projections", not (self.regenerate_projections and self.distribution != "rademacher"),
                      "false with distribution 'gaussian' (Gaussian projections are stored)")
        check.names("target_modules", allow_dots=False)
        check.number("beta2", above=0, below=1)
        check.number("epsilon", above=0)
        check.number("update_ratio", above=0)
        check.boolean("follow_lr_schedule")
        check.boolean("kl_control")
        check.number("kl_budget", above=0)
        check.number("kl_budget_final", above=0)
        check.integer("schedule_steps", at_least=1)
        check.number("alpha_max", at_least=1)
        check.number("probe_temperature", above=0, optional=True)
        check.choice("kl_probe", ("weighted", "stratified", "reference"))
        check.integer("probe_responses", at_least=1, optional=True)
        check.integer("probe_max_tokens", at_least=1)
        check.integer("probe_chunk_positions", at_least=1)
        check.integer("probe_mlp_chunk_tokens", at_least=1)
        check.boolean("mismatch_subtraction")
        check.number("mismatch_ema_weight", above=0, at_most=1)
        check.number("mismatch_budget_floor", above=0, at_most=1)
        check.choice("update_factor_dtype", ("bfloat16", "float32"))
        check.choice("sketch_reduction", ("auto", "all_reduce", "reduce_scatter"))
        check.choice("sketch_accumulation", ("auto", "sharded", "local"))
        check.require(
            "sketch_accumulation",
            not (self.sketch_accumulation == "sharded" and self.sketch_reduction == "all_reduce"),
            "'local' or 'auto' with sketch_reduction='all_reduce' (every rank then needs every row)",
        )
        check.integer("update_chunk_rows", at_least=1)
        check.choice("on_nonfinite", ("skip", "raise"))
        check.integer("max_consecutive_skips", at_least=1)

    def probe_rows(self) -> int:
        """Responses per rank the KL probe runs on (``probe_responses`` or its default)."""
        if self.probe_responses is not None:
            return self.probe_responses
        return REFERENCE_PROBE_RESPONSES if self.kl_probe == "reference" else DRAWN_PROBE_RESPONSES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoGRAConfig:
        """From a dict of fields (a YAML mapping, ``to_dict``'s output); deprecated names are
        accepted, and warn, as keyword arguments do."""
        known = {f.name for f in fields(cls)} | set(DEPRECATED_ALIASES)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"LoGRAConfig: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def structural_mismatches(self, other: dict[str, Any]) -> list[str]:
        """``"field: saved != mine"`` for every field in STRUCTURAL_FIELDS whose value differs
        from ``other`` (a saved configuration: deprecated names are read as the new ones); a
        field ``other`` lacks counts as its default.

        A rank of ``"auto"`` is compared as written: compare the resolved configuration
        (``LoGRAOptimizer.config`` after construction holds the int in use)."""
        other = saved_config(other)
        mine = self.to_dict()
        defaults = _defaults()
        saved = {name: other.get(name, defaults[name]) for name in STRUCTURAL_FIELDS}
        return [f"{name}: {saved[name]!r} != {mine[name]!r}" for name in STRUCTURAL_FIELDS if saved[name] != mine[name]]

    def tuning_changes(self, other: dict[str, Any]) -> list[str]:
        """``"field: old -> new"`` for every non-structural field whose value differs from
        ``other`` (the configuration a checkpoint was written with; deprecated names are read
        as the new ones)."""
        other = saved_config(other)
        mine = self.to_dict()
        return [
            f"{name}: {other[name]!r} -> {mine[name]!r}"
            for name in mine
            if name not in STRUCTURAL_FIELDS and name in other and other[name] != mine[name]
        ]


def saved_config(values: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration (a checkpoint's) under today's field names: keys written under
    a deprecated name (``DEPRECATED_ALIASES``) are renamed, silently. Raises ``ValueError``
    if one holds both a deprecated name and its new name."""
    renamed = dict(values)
    for old, new in DEPRECATED_ALIASES.items():
        if old in renamed:
            if new in renamed:
                raise ValueError(f"saved LoGRA configuration holds both {old!r} and {new!r} "
                                 f"({old} is the deprecated name of {new})")
            renamed[new] = renamed.pop(old)
    return renamed


def _defaults() -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(LoGRAConfig)}
