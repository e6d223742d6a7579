import pytest

from lightning_logra.sandbox import SandboxLimits


def test_defaults_are_valid():
    limits = SandboxLimits()
    assert limits.timeout_s > 0 and limits.memory_bytes >= 64 * 2**20 and not limits.allow_unisolated


@pytest.mark.parametrize(("field", "value"), [
    ("timeout_s", 0.0), ("timeout_s", float("nan")), ("timeout_s", True), ("cpu_time_s", 0), ("cpu_time_s", 1.5),
    ("memory_bytes", 2**20), ("max_file_bytes", -1), ("max_output_bytes", 0), ("allow_unisolated", 1),
    ("max_disk_bytes", 2**10), ("max_files", 1), ("max_threads", 0), ("max_threads", 2.0),
])
def test_a_bad_limit_is_named(field, value):
    with pytest.raises(ValueError, match=rf"SandboxLimits\.{field} = "):
        SandboxLimits(**{field: value})
