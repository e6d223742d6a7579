"""The checkpoint folders' writer lock (issue 42, section 5): taken at start-up before any
recovery, taken over atomically, and leased: a lock not renewed within its lease is taken
over from any host, with a warning naming the old holder."""

import errno
import fcntl
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_logra import LoGRAFabricStrategy, LoGRAFSDPStrategy
from lightning_logra.callbacks import PreemptionCheckpoint
from lightning_logra.strategies.checkpoints import atomic, writer_lock
from lightning_logra.strategies.trainer import claim_checkpoint_folders
from lightning_logra.strategies.checkpoints.writer_lock import FolderLocked, LostLock, WriterLock
from tests.helpers.lightning import CausalLM, config, in_process_cli, loader, trainer

HOST = socket.gethostname()


def dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def write_lock(folder, **holder):
    """A lock file as another run would have written it (under the flock, as runs do)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / writer_lock.LOCK_NAME, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps(holder))


def read_lock(folder):
    return json.loads((folder / writer_lock.LOCK_NAME).read_text())


def live_holder(**changes):
    """Another process of this host, alive (the test runner's parent), its lease just renewed."""
    return {"pid": os.getppid(), "host": HOST, "renewed_at": time.time(), "lease_s": 600.0, **changes}


def save_in_progress(folder):
    """What a live run's save of last.ckpt looks like while its ranks write: an unmarked partial folder."""
    partial = atomic.partial_path(folder / "last.ckpt")
    (partial / "logra").mkdir(parents=True)
    return partial


# -- At start-up, before any recovery --


class CountsSteps(CausalLM):
    steps = 0

    def training_step(self, batch, batch_idx):
        CountsSteps.steps += 1
        return super().training_step(batch, batch_idx)


def test_a_second_run_is_refused_at_start_and_leaves_the_live_runs_save_alone(tmp_path):
    folder = tmp_path / "ckpt"
    write_lock(folder, **live_holder())
    partial = save_in_progress(folder)
    CountsSteps.steps = 0
    callbacks = [ModelCheckpoint(dirpath=folder, every_n_train_steps=1)]
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match=rf"held by pid {os.getppid()} on '{HOST}'"):
        warnings.simplefilter("ignore")
        trainer(LoGRAFSDPStrategy(logra=config()), max_steps=2, tmp_path=tmp_path, callbacks=callbacks,
                enable_checkpointing=True).fit(CountsSteps(), loader(16))
    assert CountsSteps.steps == 0  # refused before the first step, not at the first save
    assert partial.is_dir()  # start-up recovery did not delete the live run's save in progress
    assert read_lock(folder)["pid"] == os.getppid()


def test_logra_fit_locks_before_it_recovers(tmp_path):
    """The CLI recovers before Lightning resolves --ckpt_path=last, so it takes the lock first."""
    folder = tmp_path / "ckpt"
    write_lock(folder, **live_holder())
    partial = save_in_progress(folder)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(f"""
trainer:
  accelerator: cpu
  logger: false
  default_root_dir: {tmp_path}
  strategy: logra_fsdp
  callbacks: [{{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {{dirpath: {folder}}}}}]
model:
  class_path: tests.helpers.lightning.TinyCausalLM
""")
    cli = in_process_cli(config_file)
    try:
        with pytest.raises(FolderLocked, match="another run writes checkpoints into"):
            cli.before_fit()
    finally:
        writer_lock.release_all()  # the root folder, locked before the refusal
    assert partial.is_dir()


def test_a_folder_the_run_only_reads_is_recovered_only_when_no_live_run_holds_it(tmp_path):
    held, free = tmp_path / "held", tmp_path / "free"
    write_lock(held, **live_holder())
    kept = save_in_progress(held)
    save_in_progress(free)
    run = L.Trainer(accelerator="cpu", logger=False, default_root_dir=held, enable_progress_bar=False,
                    callbacks=[ModelCheckpoint(dirpath=free)])
    claim_checkpoint_folders(run)  # holds free (written), reads held (default_root_dir)
    try:
        assert kept.is_dir() and read_lock(held)["pid"] == os.getppid()
        assert sorted(p.name for p in free.iterdir()) == [writer_lock.LOCK_NAME]  # recovered, and locked
        assert read_lock(free)["pid"] == os.getpid()
    finally:
        writer_lock.release(free)
    assert list(free.iterdir()) == []


def test_a_preemption_checkpoint_makes_the_root_folder_one_the_run_writes(tmp_path):
    write_lock(tmp_path, **live_holder())
    run = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                    callbacks=[PreemptionCheckpoint()])
    with pytest.raises(FolderLocked, match="trainer.default_root_dir"):
        claim_checkpoint_folders(run)


# -- Atomic takeover --


def _race(folder, rounds, start, done, released, results):
    for _ in range(rounds):
        start.wait()
        lock = WriterLock(folder)
        try:
            lock.acquire(wait=False)
            won = True
        except FolderLocked:
            won = False
        results.put(won)
        done.wait()
        if won:
            lock.release()
        released.wait()


def test_of_two_runs_that_find_the_same_stale_lock_exactly_one_takes_it_over(tmp_path):
    rounds = 150
    context = multiprocessing.get_context("fork")
    start, done, released = (context.Barrier(3) for _ in range(3))
    results = context.Queue()
    racers = [context.Process(target=_race, args=(tmp_path, rounds, start, done, released, results)) for _ in range(2)]
    for racer in racers:
        racer.start()
    winners = []
    stale = [{"pid": dead_pid(), "host": HOST, "renewed_at": time.time(), "lease_s": 600.0},  # died on this host
             {"pid": 1, "host": "node-a", "renewed_at": time.time() - 3600, "lease_s": 600.0}]  # lease ran out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each takeover warns
        for round_ in range(rounds):
            write_lock(tmp_path, **stale[round_ % 2])
            start.wait()
            done.wait()
            winners.append(results.get(timeout=30) + results.get(timeout=30))
            released.wait()
    for racer in racers:
        racer.join(timeout=30)
        assert racer.exitcode == 0
    assert winners == [1] * rounds


# -- The lease --


def test_another_hosts_lock_whose_lease_ran_out_is_taken_over_with_a_warning_naming_it(tmp_path):
    write_lock(tmp_path, pid=4242, host="node-a", renewed_at=time.time() - 700, lease_s=600.0)
    lock = WriterLock(tmp_path)
    with pytest.warns(UserWarning, match=r"pid 4242 on 'node-a' \(last renewed .*\) is gone"):
        lock.acquire()
    try:
        assert read_lock(tmp_path)["pid"] == os.getpid() and read_lock(tmp_path)["host"] == HOST
    finally:
        lock.release()


def test_another_hosts_unexpired_lease_is_waited_for_then_taken_over(tmp_path):
    write_lock(tmp_path, pid=4242, host="node-a", renewed_at=time.time() - 600 + 1.5, lease_s=600.0)
    lock = WriterLock(tmp_path)
    started = time.monotonic()
    with pytest.warns(UserWarning, match="pid 4242 on 'node-a'"):
        lock.acquire()
    lock.release()
    assert 1.0 < time.monotonic() - started < 10


def test_a_lease_renewed_while_waiting_is_a_live_run_and_refused(tmp_path):
    renewed_at = time.time() - 600 + 5
    write_lock(tmp_path, pid=4242, host="node-a", renewed_at=renewed_at, lease_s=600.0)
    renewal = threading.Timer(0.5, write_lock, args=(tmp_path,),
                              kwargs=dict(pid=4242, host="node-a", renewed_at=renewed_at + 2, lease_s=600.0))
    renewal.start()
    with pytest.raises(FolderLocked, match="pid 4242 on 'node-a'.*renewed its lease while this run waited"):
        WriterLock(tmp_path).acquire()
    renewal.join()


def test_a_live_process_of_this_host_is_refused_at_once_unless_its_lease_ran_out(tmp_path):
    write_lock(tmp_path, **live_holder())
    started = time.monotonic()
    with pytest.raises(FolderLocked, match=rf"held by pid {os.getppid()} on '{HOST}' .*its process is running"):
        WriterLock(tmp_path).acquire()
    assert time.monotonic() - started < 1
    write_lock(tmp_path, **live_holder(renewed_at=time.time() - 601))  # alive but not renewing: hung
    lock = WriterLock(tmp_path)
    with pytest.warns(UserWarning, match=f"pid {os.getppid()}"):
        lock.acquire()
    lock.release()


def test_the_heartbeat_renews_the_lease_until_release_removes_the_lock(tmp_path):
    lock = WriterLock(tmp_path, lease_s=10.5)
    lock.acquire()
    first = read_lock(tmp_path)["renewed_at"]
    assert lock._heartbeat.daemon  # never keeps the process alive
    time.sleep(3.8)  # one beat: every lease / 3
    assert read_lock(tmp_path)["renewed_at"] > first
    lock.release()
    assert lock._heartbeat is None and not (tmp_path / writer_lock.LOCK_NAME).exists()


def test_a_run_whose_lock_was_taken_over_refuses_to_save(tmp_path):
    lock = WriterLock(tmp_path)
    lock.acquire()
    write_lock(tmp_path, pid=4242, host="node-b", renewed_at=time.time(), lease_s=600.0)
    with pytest.raises(LostLock, match="pid 4242 on 'node-b'"):
        lock.renew()
    lock.release()
    assert read_lock(tmp_path)["host"] == "node-b"  # the new holder's lock stays


@pytest.mark.parametrize("strategy", [LoGRAFSDPStrategy, LoGRAFabricStrategy])
@pytest.mark.parametrize("lease", [5, float("inf"), "600"])
def test_the_lease_is_validated(strategy, lease):
    with pytest.raises(ValueError, match=rf"{strategy.__name__}\.checkpoint_lock_lease_s = .* is invalid: .* >= 10"):
        strategy(checkpoint_lock_lease_s=lease)


def test_a_filesystem_without_flock_is_a_clear_error(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(writer_lock.fcntl, "flock", no_flock)
    with pytest.raises(RuntimeError, match="does not support flock .*No locks available"):
        WriterLock(tmp_path).acquire()
