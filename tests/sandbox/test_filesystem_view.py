"""What a program sees of the filesystem in the namespaces: a new root holding the
interpreter, its standard library, the shared libraries they load and ``setpriv``, read-only,
and its working directory; never the trainer's files, the package's source, the data on disk
or the host's credentials."""

import ast
import os
import sys
import tempfile
from pathlib import Path

import pytest

import lightning_logra
from lightning_logra.sandbox import SandboxLimits, isolation, namespaces_problem, run_python, view, workdir
from tests.helpers.sandbox import TYPICAL_PROGRAM

NAMESPACES = namespaces_problem()
pytestmark = pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
ROOMY = SandboxLimits(timeout_s=30.0, cpu_time_s=30)
PACKAGE = Path(lightning_logra.__file__).resolve().parent
# Prints, for each path, what a program gets: the entries of a directory, the start of a file,
# or the exception's name (a tab between the path and that).
LOOK = """
import os
for path in PATHS:
    try:
        seen = sorted(os.listdir(path)) if os.path.isdir(path) else open(path, 'rb').read(20)
    except OSError as error:
        seen = type(error).__name__
    print(repr(path), repr(seen), sep='\t')
"""
STDLIB_MODULES = ["json", "re", "math", "collections", "itertools", "functools", "fractions", "decimal", "datetime",
                  "random", "string", "heapq", "bisect", "typing", "dataclasses", "statistics"]


@pytest.fixture(autouse=True)
def workdirs_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def look(paths: list[str]) -> dict[str, object]:
    result = run_python(LOOK.replace("PATHS", repr(paths)), ROOMY)
    assert result.status == "ok", result.output
    lines = (line.split("\t") for line in result.output.splitlines())
    return {ast.literal_eval(path): ast.literal_eval(seen) for path, seen in lines}


def on_the_way_to_the_interpreter(directory: str) -> set[str]:
    """The names in ``directory`` that lead to the interpreter (``/root/.pyenv`` on a
    machine whose Python pyenv installed): the only entries the program may see there."""
    names = set()
    for path in (isolation.interpreter(), os.path.realpath(isolation.interpreter()), sys.base_prefix):
        if path.startswith(directory.rstrip("/") + "/"):
            names.add(path[len(directory.rstrip("/")) + 1:].split("/")[0])
    return names


def test_the_data_on_disk_cannot_be_read(tmp_path):
    """A code reward's hidden tests in a JSONL beside the run (or anywhere else on disk):
    a program that read them could answer from them. It used to read them."""
    tests = tmp_path / "tests.jsonl"
    tests.write_text('{"input": [1], "expected": 42}\n')
    seen = look([str(tests), str(tmp_path)])
    assert seen[str(tests)] == "FileNotFoundError"
    assert len(seen[str(tmp_path)]) == 1 and seen[str(tmp_path)][0].startswith(workdir.PREFIX)  # its own, only


def test_the_package_source_cannot_be_read():
    """The built-in code task's generator computes the expected values."""
    seen = look([str(PACKAGE / "data" / "code_tasks.py"), str(PACKAGE)])
    assert set(seen.values()) == {"FileNotFoundError"}, seen


@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd", "/root/.bashrc", "/root/.cache"])
def test_credentials_and_host_accounts_cannot_be_read(path):
    assert look([path]) == {path: "FileNotFoundError"}


@pytest.mark.parametrize("directory", ["/root", "/home", "/etc", "/", "/usr", "/tmp"])
def test_a_directory_shows_only_what_the_interpreter_needs(directory):
    seen = look([directory])[directory]
    allowed = {"/": {"usr", "bin", "lib", "lib64", "sbin", "etc", "proc", "tmp", "root"},
               "/etc": {"ld.so.cache", "localtime"}, "/usr": {"bin", "lib", "lib64", "share", "sbin"},
               "/tmp": set()}.get(directory, set())
    allowed |= on_the_way_to_the_interpreter(directory) | on_the_way_to(directory, tempfile.gettempdir())
    assert seen == "FileNotFoundError" or set(seen) <= allowed, seen


def on_the_way_to(directory: str, path: str) -> set[str]:
    prefix = directory.rstrip("/") + "/"
    return {path[len(prefix):].split("/")[0]} if path.startswith(prefix) else set()


def test_proc_shows_only_the_sandboxs_own_processes():
    """Process 1 (the launcher) and the program. (True before the new root too: ``/proc``
    is mounted again inside it, for the new PID namespace.)"""
    result = run_python("import os\nprint(sorted(int(name) for name in os.listdir('/proc') if name.isdigit()))", ROOMY)
    assert result.output.strip() == "[1, 2]", result.output


def test_the_host_root_is_not_reachable_through_proc():
    """The old root is unmounted after ``pivot_root``: the program's root and process 1's
    are the new one (process 1's is not the program's to open at all)."""
    seen = look(["/proc/self/root/work", "/proc/self/root/home", "/proc/1/root/home", "/proc/1/cwd/home"])
    assert [seen["/proc/self/root/work"], seen["/proc/self/root/home"]] == ["FileNotFoundError"] * 2, seen
    assert {seen["/proc/1/root/home"], seen["/proc/1/cwd/home"]} <= {"FileNotFoundError", "PermissionError"}, seen


def test_the_standard_library_and_a_typical_program_still_work():
    program = f"import {', '.join(STDLIB_MODULES)}\nprint('imports ok')\n" + TYPICAL_PROGRAM
    result = run_python(program, ROOMY)
    assert (result.status, result.output) == ("ok", "imports ok\ntypical ok\n"), result.output


def test_site_packages_are_hidden():
    """Where the package is installed rather than edited in place, its source (and every
    other installed package) lives in site-packages."""
    import site
    import sysconfig

    folders = [path for path in {*site.getsitepackages(), sysconfig.get_path("purelib")} if os.path.isdir(path)]
    seen = look(folders)
    assert all(entries in ([], "FileNotFoundError") for entries in seen.values()), seen


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no /usr/bin/python3 here")
def test_the_view_works_for_the_systems_python(monkeypatch):
    """The view follows the interpreter: Debian's keeps its standard library in
    /usr/lib/python3.X, its packages in /usr/lib/python3/dist-packages (hidden)."""
    monkeypatch.setattr(isolation, "interpreter", lambda: "/usr/bin/python3")
    program = (f"import sys, os, {', '.join(STDLIB_MODULES)}\nprint(sys.executable)\n"
               "print(os.path.exists('/etc/passwd'), os.path.exists('/usr/lib/python3/dist-packages/README'))\n"
               + TYPICAL_PROGRAM)
    result = run_python(program, ROOMY)
    assert result.status == "ok", result.output
    assert result.output.splitlines() == ["/usr/bin/python3", "False False", "typical ok"], result.output


def test_a_view_that_cannot_be_built_ends_the_run_before_the_program(monkeypatch):
    """Fail closed: a path that cannot be bound (gone since the view was worked out) is a
    setup failure, never a program run with the host's files."""
    built = view.filesystem(isolation.interpreter(), isolation.tool("setpriv"))
    broken = {**built, "binds": [*built["binds"], "/nonexistent-logra-view-path"]}
    monkeypatch.setattr(view, "filesystem", lambda interpreter, setpriv: broken)
    result = run_python("print('ran')", ROOMY)
    assert result.status == "setup_failed" and "ran" not in result.output, result.output
    assert "/nonexistent-logra-view-path" in result.output
