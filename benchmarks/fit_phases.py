"""Phase marks for ``benchmarks.fit_memory``: a ``GRPOModule`` that appends, at the start of
each phase of a ``logra fit``, a line ``<wall time> <rank> <phase>`` to the file named by
``FIT_MEMORY_PHASES``, so that RSS samples taken from outside can be attributed to a phase
(``fit_memory.PHASES`` says what each phase holds).

With ``FIT_MEMORY_ACCOUNTS`` set, each rank also splits its memory: a thread samples its RSS
and glibc's counters (``mallinfo2``: bytes in use in its arenas, kept free in them, and in
mmapped blocks) every ``ACCOUNT_SAMPLE_S``, and the end of each phase adds a census of the
live CPU tensors (storages counted once), one line per sample or census in
``<that path>.<rank>``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import threading
import time
from pathlib import Path

import torch

from typing_extensions import override

from lightning_logra.modules import GRPOModule

from .fit_memory import ACCOUNTS_VARIABLE, MARKS_VARIABLE

ACCOUNT_SAMPLE_S = 0.1
PAGE = os.sysconf("SC_PAGE_SIZE")


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h), all fields ``size_t``."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2``, looked up once (the sampler calls it every 0.1 s)."""
    function = ctypes.CDLL(None).mallinfo2
    function.restype = MallInfo2
    return function


def allocator_sample() -> str:
    """``rss arena_in_use arena_free mmapped`` in bytes, now."""
    info = _mallinfo2()()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * PAGE
    return f"{rss} {info.uordblks} {info.fordblks} {info.hblkhd}"


def live_tensor_bytes() -> int:
    """Bytes of the CPU tensor storages Python can reach (each storage once)."""
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
            continue
    return sum(storages.values())


class AllocatorAccounts:
    """One rank's samples and censuses, appended to ``<FIT_MEMORY_ACCOUNTS>.<rank>``."""

    def __init__(self, rank: int) -> None:
        self.path = Path(f"{os.environ[ACCOUNTS_VARIABLE]}.{rank}")
        self.lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _write(self, line: str) -> None:
        with self.lock, self.path.open("a") as out:
            out.write(line + "\n")

    def _sample(self) -> None:
        while True:
            self._write(f"{time.time():.3f} sample {allocator_sample()}")
            time.sleep(ACCOUNT_SAMPLE_S)

    def census(self, phase: str) -> None:
        self._write(f"{time.time():.3f} census {live_tensor_bytes()} {phase}")


class PhaseMarkingGRPOModule(GRPOModule):
    """``GRPOModule`` with phase marks (the library's own code runs unchanged between them)."""

    _accounts: AllocatorAccounts | None = None
    _phase = "start-up"

    def _mark(self, phase: str) -> None:
        if self._accounts is None and os.environ.get(ACCOUNTS_VARIABLE):
            self._accounts = AllocatorAccounts(self.global_rank)
        if self._accounts is not None:
            self._accounts.census(self._phase)  # the phase this mark ends
        self._phase = phase
        with Path(os.environ[MARKS_VARIABLE]).open("a") as marks:
            marks.write(f"{time.time():.3f} {self.global_rank} {phase}\n")

    @override
    def configure_model(self) -> None:
        super().configure_model()
        self._mark("loading")  # the strategy shards and fills the empty models next

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        runtime = self.trainer.strategy.runtime
        step = runtime.step

        @functools.wraps(step)
        def marked_step(*args, **kwargs):
            self._mark("LoGRA update")
            try:
                return step(*args, **kwargs)
            finally:
                self._mark("after the step")

        runtime.step = marked_step

    @override
    def on_fit_end(self) -> None:
        super().on_fit_end()
        if self._accounts is not None:
            self._accounts.census(self._phase)

    def _rollouts(self, *args, **kwargs):
        self._mark("generation")
        try:
            return super()._rollouts(*args, **kwargs)
        finally:
            self._mark("scoring and reference")

    def _update(self, *args, **kwargs):
        self._mark("forward and backward")
        return super()._update(*args, **kwargs)
