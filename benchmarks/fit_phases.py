"""Phase marks for ``benchmarks.fit_memory``: a ``GRPOModule`` that appends, at the start of
each phase of a ``logra fit``, a line ``<wall time> <rank> <phase>`` to the file named by
``FIT_MEMORY_PHASES``, so that RSS samples taken from outside can be attributed to a phase
(``fit_memory.PHASES`` says what each phase holds).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from typing_extensions import override

from lightning_logra.modules import GRPOModule

from .fit_memory import MARKS_VARIABLE


class PhaseMarkingGRPOModule(GRPOModule):
    """``GRPOModule`` with phase marks (the library's own code runs unchanged between them)."""

    def _mark(self, phase: str) -> None:
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

    def _rollouts(self, *args, **kwargs):
        self._mark("generation")
        try:
            return super()._rollouts(*args, **kwargs)
        finally:
            self._mark("scoring and reference")

    def _update(self, *args, **kwargs):
        self._mark("forward and backward")
        return super()._update(*args, **kwargs)
