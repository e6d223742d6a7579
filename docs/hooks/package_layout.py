"""MkDocs hook: tables of a package's modules, from the modules' own docstrings.

A page writes ``<!-- modules: lightning_logra.core -->`` where the table goes; the hook
replaces it with one row per module of that package (``__init__`` left out): its file name
and the first paragraph of its docstring. Read with ``ast``, nothing is imported, and a
module added, renamed or removed shows up at the next build.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

MARKER = re.compile(r"<!--\s*modules:\s*([\w.]+)\s*-->")


def module_table(root: Path, package: str) -> str:
    folder = root.joinpath(*package.split("."))
    if not folder.is_dir():
        raise ValueError(f"<!-- modules: {package} -->: no package folder {folder}")
    rows = ["| module | what it holds |", "|---|---|"]
    for path in sorted(folder.glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        first = re.sub(r"``(.+?)``", r"`\1`", first).replace("|", "\\|")
        rows.append(f"| `{path.name}` | {first} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    root = Path(config.config_file_path).resolve().parent
    return MARKER.sub(lambda match: module_table(root, match.group(1)), markdown)
