"""Checks that a sandboxed run left nothing behind: no process, no file."""

from __future__ import annotations

from pathlib import Path

import psutil


def processes_under(folder: Path) -> list[str]:
    """Processes whose command line or working directory names ``folder`` (every sandboxed
    process starts in a working directory made there, and the launcher's command line
    names it), described for an assertion message."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmdline, cwd = " ".join(process.info["cmdline"] or ()), process.info["cwd"] or ""
        if str(folder) in cmdline or cwd.startswith(str(folder)):
            found.append(f"{process.info['pid']}: {cmdline[:200]} (in {cwd})")
    return found


def files_under(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))
