"""The checks every configuration class uses: one message style, finite numbers, no bools for numbers."""

import re
import warnings
from types import SimpleNamespace

import pytest

from lightning_logra.core.validation import FieldChecks, deprecated_attributes, renamed_field


def refused(check: str, value, **bounds) -> str:
    with pytest.raises(ValueError) as error:
        getattr(FieldChecks("Owner", {"field": value}), check)("field", **bounds)
    return str(error.value)


def test_an_error_names_the_class_field_value_and_allowed_range():
    assert refused("integer", 0, at_least=1) == "Owner.field = 0 is invalid: must be an integer >= 1"
    assert refused("number", 1.5, above=0, at_most=1) == "Owner.field = 1.5 is invalid: must be a finite number in (0, 1]"
    assert refused("number", -1, at_least=0, at_most=1) == "Owner.field = -1 is invalid: must be a finite number in [0, 1]"
    assert refused("number", 1.0, above=0, below=1) == "Owner.field = 1.0 is invalid: must be a finite number in (0, 1)"
    assert refused("boolean", 1) == "Owner.field = 1 is invalid: must be true or false"
    assert refused("choice", "c", options=("a", "b")) == "Owner.field = 'c' is invalid: must be one of 'a', 'b'"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10**400])
def test_a_number_must_be_finite(value):
    assert "must be a finite number" in refused("number", value)


@pytest.mark.parametrize("check", ["integer", "number"])
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_not_a_number(check, value):
    assert f"Owner.field = {value} is invalid" in refused(check, value)


@pytest.mark.parametrize("value", [1.0, "1", None])
def test_an_integer_is_an_int(value):
    assert "must be an integer" in refused("integer", value)


def test_optional_accepts_none_and_says_so():
    FieldChecks("Owner", {"field": None}).integer("field", at_least=1, optional=True)
    FieldChecks("Owner", {"field": None}).number("field", above=0, optional=True)
    assert refused("integer", 0, at_least=1, optional=True).endswith("an integer >= 1 or None")


def test_ints_are_numbers_and_bounds_hold_at_the_edges():
    check = FieldChecks("Owner", {"zero": 0, "one": 1, "half": 0.5})
    check.number("zero", at_least=0)
    check.number("one", above=0, at_most=1)
    check.integer("one", at_least=1, at_most=1)
    check.number("half", above=0, below=1)


def test_a_renamed_field_warns_once_per_name_and_returns_the_old_value(no_alias_warned_yet):
    with pytest.warns(FutureWarning, match=re.escape("Owner.old is deprecated: use new")):
        assert renamed_field("Owner", "old", "new", 5, 1, 1) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed_field("Owner", "old", "new", 6, 1, 1) == 6  # warned already
        assert renamed_field("Owner", "old", "new", None, 7, 1) == 7  # not given


def test_a_renamed_field_given_under_both_names_raises(no_alias_warned_yet):
    with pytest.raises(ValueError, match=r"Owner.old = 5 and Owner.new = 2 are both given.*give new only"):
        renamed_field("Owner", "old", "new", 5, 2, 1)


def test_a_name_deprecated_for_a_group_field_reads_it_and_refuses_writes(no_alias_warned_yet):
    @deprecated_attributes({"old": "group.new"})
    class Owner:
        def __init__(self):
            self.group = SimpleNamespace(new=3)

    owner = Owner()
    with pytest.warns(FutureWarning, match=re.escape("Owner.old is deprecated: use group.new")):
        assert owner.old == 3
    with pytest.raises(AttributeError, match=r"Owner\.old is deprecated and read-only: set group\.new when building"):
        owner.old = 4
    assert owner.group.new == 3
