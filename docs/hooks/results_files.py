"""MkDocs hook: the benchmarks' results, served from where the benchmarks write them.

Every ``benchmarks/results/*.png`` and ``*.json`` is added to the build as
``results/data/<name>``, so the results pages show the figures and link the raw data
without a copy in ``docs/``. The tables themselves are included by pymdownx.snippets
(``--8<-- "benchmarks/results/<name>.md"``), so each number lives in one file; a results
table that no page includes is reported as a warning (an error under ``--strict``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

SUFFIXES = (".png", ".json")
INCLUDE = re.compile(r"""--8<--\s+["']benchmarks/results/([^"']+\.md)["']""")

log = logging.getLogger("mkdocs.hooks.results_files")
_included: set[str] = set()


def _results(config) -> Path:
    return Path(config.config_file_path).resolve().parent / "benchmarks" / "results"


def on_pre_build(config):
    _included.clear()


def on_files(files, config):
    from mkdocs.structure.files import File

    results = _results(config)
    for path in sorted(results.iterdir()) if results.is_dir() else ():
        if path.suffix in SUFFIXES:
            files.append(File.generated(config, f"results/data/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    _included.update(INCLUDE.findall(markdown))
    return markdown


def on_post_build(config):
    results = _results(config)
    tables = {path.name for path in results.glob("*.md")} if results.is_dir() else set()
    for name in sorted(tables - _included):
        log.warning(f"benchmarks/results/{name} is included by no page under docs/results/: "
                    f'add --8<-- "benchmarks/results/{name}" to one')
