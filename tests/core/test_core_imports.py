"""lightning_logra.core is the algorithm in plain torch: it imports the standard library,
torch and itself, nothing else (no Lightning, transformers, peft, vLLM or MLflow)."""

import ast
import sys
from pathlib import Path

import lightning_logra.core

CORE = Path(lightning_logra.core.__file__).parent


def imported_packages(path: Path) -> set[str]:
    """The top-level name of every module ``path`` imports, at any depth in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_only_torch_the_standard_library_and_itself():
    foreign = {}
    for path in sorted(CORE.glob("*.py")):
        for name in imported_packages(path):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or top == "torch" or name.startswith("lightning_logra.core")
            if not allowed:
                foreign.setdefault(path.name, []).append(name)
    assert not foreign, f"core imports beyond torch and the standard library: {foreign}"


def test_the_check_sees_a_forbidden_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\ndef f():\n    from lightning.pytorch import Trainer\n")
    assert imported_packages(sample) == {"torch", "lightning.pytorch"}
