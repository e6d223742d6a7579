"""The import contracts of pyproject.toml's [tool.importlinter] hold: the layers of
docs/design.md (core at the bottom, cli on top, siblings joined by | independent), core and
the plain-torch layers free of Lightning, and no import cycles in the library or the
benchmarks."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(folder: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package in ``folder``, in a subprocess: in this process grimp
    would find the already-imported package, and import-linter reconfigures logging (which
    later tests' ``caplog`` would miss)."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=folder, env={**os.environ, "PYTHONPATH": str(folder)},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold_with_no_exception_recorded():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert not [contract["name"] for contract in contracts if contract.get("ignore_imports")]


@pytest.mark.integration
def test_the_contracts_catch_a_rollout_module_reaching_up_to_the_strategy_contract(tmp_path):
    """On a copy of the package, the import rollout/ had before it moved out (the strategy
    contract, ``hooks``) breaks the layers contract, by name."""
    shutil.copytree(ROOT / "lightning_logra", tmp_path / "lightning_logra", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    engines = tmp_path / "lightning_logra" / "rollout" / "engines.py"
    engines.write_text(engines.read_text() + "\nfrom lightning_logra.hooks import ReportsLoGRASteps\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "lightning_logra.rollout is not allowed to import lightning_logra.hooks" in run.stdout
