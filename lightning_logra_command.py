"""The ``logra`` command's entry point, outside the ``lightning_logra`` package on purpose:
the command restarts itself once with glibc's small-block caches off
(``lightning_logra/allocator.py``), and importing the package first (torch, Lightning,
transformers: about 5 s) would be paid twice. This module imports nothing heavy before
that restart: it loads the allocator module from its file, which needs only the standard
library."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_allocator() -> ModuleType:
    """``lightning_logra.allocator`` loaded from its file, without importing the package
    (finding a package's folder does not run its ``__init__``)."""
    package = importlib.util.find_spec("lightning_logra")
    folder = Path(next(iter(package.submodule_search_locations)))
    spec = importlib.util.spec_from_file_location("lightning_logra_allocator", folder / "allocator.py")
    allocator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(allocator)
    return allocator


def restart_with_tuned_malloc() -> None:
    """``lightning_logra.allocator.restart_with_tuned_malloc``, before the package is imported."""
    load_allocator().restart_with_tuned_malloc()


def main() -> None:
    restart_with_tuned_malloc()
    from lightning_logra.cli import main as logra  # after the restart: imported once

    logra()
