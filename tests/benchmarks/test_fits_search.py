"""The "what fits" search resolves every method's limit to one layer, whatever its start."""

import pytest

from benchmarks.fits_search import _bracket_and_bisect, largest_completed


@pytest.mark.parametrize("limit", [1, 7, 12, 41, 59])
@pytest.mark.parametrize("start", [1, 5, 12, 40, 59, 80])
def test_the_search_finds_the_deepest_depth_that_completes(limit, start):
    tried = []

    def attempt(depth):
        tried.append(depth)
        return depth <= limit

    _bracket_and_bisect(attempt, start)
    assert limit in tried and limit + 1 in tried  # resolved to one layer
    assert len(tried) == len(set(tried))  # no depth tried twice
    # Galloping from the start and bisecting: logarithmic in how far off the start was.
    assert len(tried) <= 2 * (abs(start - limit) + 1).bit_length() + 2


def test_the_search_stops_when_not_even_one_layer_completes():
    tried = []
    _bracket_and_bisect(lambda depth: tried.append(depth) or False, 6)
    assert tried[-1] == 1 and len(tried) == len(set(tried))


def test_the_largest_completed_row_is_by_parameters_among_completed_rows():
    rows = [{"method": "logra", "layers": 59, "parameters": 5, "completed": True},
            {"method": "logra", "layers": 60, "parameters": 6, "completed": False},
            {"method": "dense", "layers": 12, "parameters": 1, "completed": True}]
    assert largest_completed(rows, "logra")["layers"] == 59 and largest_completed(rows, "lora") is None
