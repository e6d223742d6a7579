"""benchmarks.fit_memory's attribution of RSS samples to the phases its marks delimit, and
its allocator environments (the shell's own allocator settings never leak into a run)."""

from benchmarks.fit_memory import (ALLOCATORS, GIB, PHASES, allocator_environment, is_rank_command, phase_accounts,
                                   phase_at, phase_peaks)


def test_a_sample_belongs_to_the_latest_phase_marked_before_it():
    marks = [(10.0, "loading"), (12.0, "generation"), (15.0, "LoGRA update")]
    assert [phase_at(marks, t) for t in (9.9, 10.0, 11.9, 12.5, 20.0)] == [
        "start-up", "loading", "loading", "generation", "LoGRA update"]


def test_phase_peaks_are_each_ranks_maximum_within_the_phase():
    marks = {0: [(10.0, "loading"), (20.0, "generation")], 1: [(11.0, "loading"), (21.0, "generation")]}
    timeline = [(5.0, 0, 0.5), (10.5, 0, 1.5), (15.0, 0, 2.0), (20.5, 0, 1.0), (10.5, 1, 0.6), (11.5, 1, 1.8)]
    peaks = phase_peaks(timeline, marks)
    assert list(peaks) == list(PHASES)
    assert peaks["start-up"] == [0.5, 0.6] and peaks["loading"] == [2.0, 1.8] and peaks["generation"] == [1.0, None]
    assert peaks["LoGRA update"] == [None, None]


def test_each_run_starts_from_its_own_allocator_settings_only():
    shell = {"PATH": "/bin", "MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": "1"}
    assert allocator_environment(shell, "library") == {"PATH": "/bin"}
    assert allocator_environment(shell, "glibc") == {"PATH": "/bin", "LIGHTNING_LOGRA_MALLOC_TUNING": "0"}
    assert allocator_environment(shell, "mmap4m")["MALLOC_MMAP_THRESHOLD_"] == str(4 * 2**20)
    assert set(ALLOCATORS) >= {"library", "glibc"}


def test_ranks_are_the_processes_running_the_cli_not_helpers_that_name_it():
    assert is_rank_command(["python", "-m", "lightning_logra.cli", "fit", "-c", "c.yaml", "--trainer.devices=2"])
    forkserver = ["python", "-B", "-c", "from multiprocessing.forkserver import main; main(3, 4, ['__main__'], "
                  "**{'sys_path': [], 'init_main_from_name': 'lightning_logra.cli'})"]
    assert not is_rank_command(forkserver)


def test_phase_accounts_split_each_phase_at_its_peak_sample_and_take_the_census_that_ends_it(tmp_path):
    marks = {0: [(10.0, "loading"), (20.0, "generation")]}
    (tmp_path / "accounts.0").write_text("\n".join([
        f"11.0 sample {2 * GIB} {GIB // 2} {GIB // 4} {GIB // 8}",
        f"12.0 sample {3 * GIB} {GIB} {GIB // 2} {GIB // 4}",  # loading's peak
        f"13.0 sample {GIB} 0 0 0",
        f"19.9 census {GIB // 2} loading",
        f"21.0 sample {GIB} 0 {GIB} 0",
        f"22.0 census {GIB // 4} generation"]))
    split = phase_accounts(tmp_path / "accounts", 1, marks)
    assert split["loading"] == [{"rss": 3.0, "arena_in_use": 1.0, "arena_free": 0.5, "mmapped": 0.25, "rest": 1.25,
                                 "live_tensors": 0.5}]
    assert split["generation"] == [{"rss": 1.0, "arena_in_use": 0.0, "arena_free": 1.0, "mmapped": 0.0, "rest": 0.0,
                                    "live_tensors": 0.25}]
    assert split["forward and backward"] == [None]
