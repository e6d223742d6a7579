"""Each rank's host memory over a whole 2-process ``logra fit``, launched as a user launches
it, against its predicted share (issue 43): the process with its imports (measured, a tiny
model on 1 process) plus ``planning.step_memory``'s step peak, within 15%. A rank that
loaded the whole model, or glibc keeping what the step frees (the allocator tuning lost),
lands above it: measured on 2026-12-05 with the 4 MiB tuning, the ranks peaked at 1.14 and
1.19 GiB against 1.22 predicted, and at 1.38 and 1.76 GiB (13% and 44% above) with glibc's
defaults."""

import pytest

from benchmarks.fit_memory import FIT_MODEL, SMOKE_MODEL, measure, predicted_gib, write_model

# FIT_MODEL with 8 of its 26 layers: 0.16B parameters, 0.59 GiB in float32.
MODEL = {**FIT_MODEL, "num_hidden_layers": 8}
TOLERANCE = 0.15


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_of_a_two_process_fit_stays_within_its_predicted_share(tmp_path):
    write_model(tmp_path / "tiny", SMOKE_MODEL)
    baseline = measure(tmp_path / "tiny", 1, "none")["rank_peak_gib"][0]
    write_model(tmp_path / "model", MODEL)
    run = measure(tmp_path / "model", 2, "none")
    predicted = predicted_gib(MODEL, 2, "none", baseline)
    for rank, peak in enumerate(run["rank_peak_gib"]):
        assert peak <= (1 + TOLERANCE) * predicted, (rank, peak, predicted)
