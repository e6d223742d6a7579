"""Checks of configuration values, in one style for every configuration class: the
dataclasses of ``core`` and ``rl``, and ``GRPOModule``'s and ``PromptDataModule``'s
arguments.

A failed check raises ``ValueError("<Class>.<field> = <value> is invalid: must be <allowed>")``.
Numbers must be finite, and ``True``/``False`` is never taken for a number, whatever Python
says (``bool`` is a subclass of ``int``). Seeds and timeouts have upper bounds too
(``MAX_SEED``, ``MAX_TIMEOUT_S``): values past them would pass here and fail at their first
use. Renamed fields keep their old names as deprecated aliases (``renamed_field`` for
keyword arguments, ``deprecated_attributes`` for attribute access), which warn once per
name per process.

Standard library only (``core`` imports nothing but torch and the standard library).
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

# "<Class>.<old name>" of every deprecated alias that has warned in this process.
_warned_aliases: set[str] = set()

# Seeds reach torch.Generator.manual_seed, which takes at most 2**64 - 1, some with an offset
# added (the epoch, + 1 for validation): a signed 64-bit bound leaves room for those.
MAX_SEED = 2**63 - 1
# threading's waits raise OverflowError past threading.TIMEOUT_MAX (9.2e9 s on Linux, 4.3e6 s
# on Windows) at the first call, not at construction; a day is longer than any call should take.
MAX_TIMEOUT_S = 86_400.0


class FieldChecks:
    """Validators for the fields of one configuration object, named ``owner`` in errors.

    ``values`` maps each field name to its value (``vars(config)`` for a dataclass, a dict
    of arguments for a class that checks its ``__init__`` arguments). Each check raises
    ``ValueError`` naming ``owner.field``, the value and what is allowed.
    """

    def __init__(self, owner: str, values: Mapping[str, Any]) -> None:
        self.owner = owner
        self.values = values

    @classmethod
    def of(cls, config: object) -> FieldChecks:
        """Checks of a dataclass instance's fields, named after its class."""
        return cls(type(config).__name__, vars(config))

    def require(self, name: str, ok: bool, allowed: str) -> None:
        """The general form: ``ok`` says whether the value of ``name`` is valid."""
        if not ok:
            raise ValueError(f"{self.owner}.{name} = {self.values[name]!r} is invalid: must be {allowed}")

    def integer(self, name: str, *, at_least: int | None = None, at_most: int | None = None,
                optional: bool = False) -> None:
        """An integer (not a bool) in ``[at_least, at_most]``; None too when ``optional``."""
        value = self.values[name]
        if optional and value is None:
            return
        ok = is_integer(value) and _within(value, None, at_least, None, at_most)
        self.require(name, ok, _allowed("an integer", None, at_least, None, at_most, optional))

    def number(self, name: str, *, above: float | None = None, at_least: float | None = None,
               below: float | None = None, at_most: float | None = None, optional: bool = False) -> None:
        """A finite real number (int or float, not a bool) with the given strict (``above``,
        ``below``) and inclusive (``at_least``, ``at_most``) bounds; None too when ``optional``."""
        value = self.values[name]
        if optional and value is None:
            return
        ok = is_finite_number(value) and _within(value, above, at_least, below, at_most)
        self.require(name, ok, _allowed("a finite number", above, at_least, below, at_most, optional))

    def seed(self, name: str) -> None:
        """A random seed: an integer in ``[0, MAX_SEED]``."""
        value = self.values[name]
        self.require(name, is_integer(value) and 0 <= value <= MAX_SEED, "an integer >= 0 and <= 2**63 - 1")

    def timeout(self, name: str) -> None:
        """Seconds to wait for a call: a finite number in ``(0, MAX_TIMEOUT_S]``."""
        value = self.values[name]
        self.require(name, is_finite_number(value) and 0 < value <= MAX_TIMEOUT_S,
                     f"a finite number > 0 and <= {MAX_TIMEOUT_S:g} (24 h)")

    def number_list(self, name: str, length: int, *, at_least: float | None = None,
                    below: float | None = None) -> None:
        """A tuple or list of ``length`` finite numbers, each within the bounds."""
        value = self.values[name]
        ok = (isinstance(value, (tuple, list)) and len(value) == length
              and all(is_finite_number(item) and _within(item, None, at_least, below, None) for item in value))
        self.require(name, ok, f"{length} " + _allowed("finite numbers", None, at_least, below, None, False))

    def boolean(self, name: str, *, optional: bool = False) -> None:
        """``True`` or ``False`` (not 0/1, not a string); None too when ``optional``."""
        value = self.values[name]
        if optional and value is None:
            return
        self.require(name, isinstance(value, bool), "true or false" + (" or None" if optional else ""))

    def choice(self, name: str, options: Iterable[str]) -> None:
        """One of ``options``."""
        options = tuple(options)
        self.require(name, self.values[name] in options, "one of " + ", ".join(repr(option) for option in options))

    def names(self, name: str, *, allow_dots: bool = True) -> None:
        """A non-empty list of non-empty strings (module names)."""
        value = self.values[name]
        ok = (isinstance(value, (list, tuple)) and len(value) > 0
              and all(isinstance(item, str) and item and (allow_dots or "." not in item) for item in value))
        what = "a non-empty list of module names"
        self.require(name, ok, what if allow_dots else what + " (last name component, e.g. 'q_proj')")


def is_integer(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A real number that is not a bool and is finite as a float (an int too large for a
    float is not)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def deprecated_attributes(aliases: Mapping[str, str]):
    """Class decorator: each deprecated name in ``aliases`` (old -> new) becomes a property
    that reads and writes the new attribute, with ``renamed_field``'s warning (once per name
    per process). Apply it above ``@dataclass``: the dataclass's ``__init__`` keeps its own
    handling of the old keyword (an ``InitVar`` with default None), and ``dataclasses.replace``
    reads None from it (not given).

    A dotted new name (``"batching.micro_batch_size"``: a field of a config group the object
    holds) is read through the group, and is read-only: the object may have built what
    depends on the group already, so a write could not take effect. Writing raises
    ``AttributeError`` naming what to set instead."""

    def decorate(cls: type) -> type:
        for old, new in aliases.items():
            setattr(cls, old, _forwarding_property(cls.__name__, old, new))
        return cls

    return decorate


def _forwarding_property(owner: str, old: str, new: str) -> property:
    path = new.split(".")

    def read(self):
        if sys._getframe(1).f_globals.get("__name__") == "dataclasses":
            # dataclasses.replace() reads every InitVar to pass it on: the old name was not given.
            return None
        warn_renamed(owner, old, new, stacklevel=2)
        return functools.reduce(getattr, path, self)

    def write(self, value):
        if len(path) > 1:
            raise AttributeError(f"{owner}.{old} is deprecated and read-only: set {new} when building the {owner}")
        warn_renamed(owner, old, new, stacklevel=2)
        setattr(self, new, value)

    return property(read, write, doc=f"Deprecated: use ``{new}``.")


def warn_renamed(owner: str, old: str, new: str, stacklevel: int = 2) -> None:
    """A ``FutureWarning`` that ``<owner>.<old>`` is deprecated for ``new``, once per name per
    process. ``stacklevel`` counts from the caller (1: the caller itself)."""
    key = f"{owner}.{old}"
    if key not in _warned_aliases:
        _warned_aliases.add(key)
        warnings.warn(f"{key} is deprecated: use {new} (same meaning; the old name will be removed)",
                      FutureWarning, stacklevel=stacklevel + 1)


def renamed_field(owner: str, old: str, new: str, old_value: Any, new_value: Any, new_default: Any, *,
                  stacklevel: int = 4) -> Any:
    """The value the field ``new`` takes when it may also have been given under its
    deprecated name ``old`` (``old_value`` None: it was not).

    Given under the old name: a ``FutureWarning`` (once per name per process), and its value.
    Given under both names (the new field differs from its default) raises ``ValueError``.
    ``stacklevel`` points the warning at the user's call (4: through a dataclass's
    ``__init__`` and ``__post_init__``).
    """
    if old_value is None:
        return new_value
    if new_value != new_default:
        raise ValueError(f"{owner}.{old} = {old_value!r} and {owner}.{new} = {new_value!r} are both given: "
                         f"{old} is the deprecated name of {new}; give {new} only")
    warn_renamed(owner, old, new, stacklevel=stacklevel)
    return old_value


def _within(value: float, above: float | None, at_least: float | None, below: float | None,
            at_most: float | None) -> bool:
    return ((above is None or value > above) and (at_least is None or value >= at_least)
            and (below is None or value < below) and (at_most is None or value <= at_most))


def _allowed(kind: str, above: float | None, at_least: float | None, below: float | None, at_most: float | None,
             optional: bool) -> str:
    """E.g. ``an integer >= 1``, ``a finite number in (0, 1]``, ``... or None``."""
    lower = (f"({above:g}", f"> {above:g}") if above is not None else (
        (f"[{at_least:g}", f">= {at_least:g}") if at_least is not None else None)
    upper = (f"{below:g})", f"< {below:g}") if below is not None else (
        (f"{at_most:g}]", f"<= {at_most:g}") if at_most is not None else None)
    if lower and upper:
        text = f"{kind} in {lower[0]}, {upper[0]}"
    elif lower or upper:
        text = f"{kind} {(lower or upper)[1]}"
    else:
        text = kind
    return text + (" or None" if optional else "")
