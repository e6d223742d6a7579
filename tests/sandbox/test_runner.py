"""One program's run: what the result says, the working directory, the environment, and
the refusal where namespaces are missing."""

import os
import socket
import tempfile
import warnings

import pytest

from lightning_logra.sandbox import SandboxLimits, SandboxUnavailable, SandboxWarning, namespaces_problem, run_python
from lightning_logra.sandbox import isolation, runner, workdir
from tests.helpers.sandbox import files_under, processes_under

NAMESPACES = namespaces_problem()
pytestmark = pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
# Generous: the machine may be loaded; the runs that should end early end in well under a second.
ROOMY = SandboxLimits(timeout_s=30.0, cpu_time_s=30)


@pytest.fixture(autouse=True)
def workdirs_in_tmp_path(tmp_path, monkeypatch):
    """Working directories are made under tmp_path, so a test can tell that they are gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_a_program_that_exits_0_is_ok_with_its_output():
    result = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)", ROOMY)
    assert (result.status, result.exit_code, result.output_truncated) == ("ok", 0, False)
    assert sorted(result.output.split()) == ["err", "out"] and result.report is None


def test_another_exit_status_is_an_error():
    result = run_python("raise SystemExit(3)", ROOMY)
    assert (result.status, result.exit_code) == ("error", 3)


def test_output_past_the_limit_is_cut_and_flagged():
    limits = SandboxLimits(timeout_s=30.0, cpu_time_s=30, max_output_bytes=1000)
    result = run_python("import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 10000)", limits)
    assert result.status == "ok" and result.output_truncated and result.output == "y" * 1000


def test_a_hanging_program_times_out_and_its_processes_are_gone(tmp_path):
    limits = SandboxLimits(timeout_s=1.0, cpu_time_s=30)
    result = run_python("import time\ntime.sleep(3600)", limits)
    assert (result.status, result.exit_code) == ("timeout", None)
    assert result.duration_s < limits.timeout_s + 1.0
    assert processes_under(tmp_path) == [] and files_under(tmp_path) == []


def test_cpu_time_past_the_limit_ends_the_program():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=30.0, cpu_time_s=1))
    assert (result.status, result.exit_code) == ("cpu_limit", 128 + 24)


def test_an_allocation_past_the_address_space_limit_is_a_memory_error():
    result = run_python("x = bytearray(2**30)", SandboxLimits(timeout_s=30.0, cpu_time_s=30, memory_bytes=256 * 2**20))
    assert (result.status, result.exit_code) == ("memory", 1)


def test_a_program_ended_by_a_signal_is_killed():
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", ROOMY)
    assert (result.status, result.exit_code) == ("killed", 128 + 11)


def test_files_written_past_the_file_size_limit_fail():
    limits = SandboxLimits(timeout_s=30.0, cpu_time_s=30, max_file_bytes=1000)
    result = run_python("with open('big.txt', 'w') as big:\n    big.write('z' * 5000)", limits)
    assert result.status == "error" and "File too large" in result.output


def test_the_report_file_comes_back_but_never_through_a_link():
    assert run_python("open('report.txt', 'w').write('3 of 4')", ROOMY).report == "3 of 4"
    assert run_python("import os\nos.symlink('/etc/hostname', 'report.txt')", ROOMY).report is None


def test_the_program_starts_alone_in_an_empty_directory_with_a_fixed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGRA_TEST_SECRET", "hunter2")
    program = ("import os, json\nprint(json.dumps({'files': sorted(os.listdir('.')), 'cwd': os.getcwd(), "
               "'env': dict(os.environ), 'pid': os.getpid()}))")
    result = run_python(program, ROOMY, files={"data.txt": "given"})
    seen = eval(result.output.replace("true", "True").replace("false", "False"))  # noqa: S307 - our own JSON
    assert seen["files"] == ["data.txt", "program.py"]
    assert seen["cwd"].startswith(str(tmp_path)) and seen["pid"] == 2  # process 1 is the launcher
    assert seen["env"] == {"PATH": runner.ENVIRONMENT_PATH, "LANG": "C.UTF-8", "HOME": seen["cwd"],
                           "TMPDIR": seen["cwd"]}
    assert files_under(tmp_path) == []  # the working directory is removed afterwards


def test_the_program_holds_no_capabilities_and_threads_work_but_processes_do_not():
    program = ("import os, threading\n"
               "print([line for line in open('/proc/self/status') if line.startswith('CapEff')][0].split()[1])\n"
               "thread = threading.Thread(target=print, args=('thread ran',)); thread.start(); thread.join()\n"
               "try:\n    os.fork()\nexcept PermissionError:\n    print('fork refused')\n")
    result = run_python(program, ROOMY)
    assert result.output.split("\n")[:3] == ["0000000000000000", "thread ran", "fork refused"]


def test_host_settings_and_device_files_cannot_be_opened_for_writing():
    """``/proc/sys`` (the host's sysctls, writable by their owner when the trainer is root)
    and device files (a disk, even ``/dev/null``) are out of reach. Opened, never written."""
    program = ("for path in ['/proc/sys/vm/overcommit_ratio', '/sys/kernel/mm/transparent_hugepage/enabled', "
               "'/dev/null']:\n"
               "    try:\n        open(path, 'r+b').close()\n        print('opened', path)\n"
               "    except OSError as error:\n        print('refused', path, error.errno)\n")
    lines = run_python(program, ROOMY).output.splitlines()
    assert [line.split()[0] for line in lines] == ["refused"] * 3, lines


def test_a_unix_socket_of_the_trainer_cannot_be_reached(tmp_path_factory):
    """A read-only mount does not stop a connection to a socket file (a container runtime's,
    say), so Unix-domain sockets are refused; socket pairs still work."""
    path = tmp_path_factory.mktemp("trainer-socket") / "trainer.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        program = (f"import socket\nleft, right = socket.socketpair()\nprint('pair')\n"
                   f"socket.socket(socket.AF_UNIX).connect({str(path)!r})\nprint('connected')")
        result = run_python(program, ROOMY)
    assert result.output.startswith("pair\n") and "connected" not in result.output
    assert "PermissionError" in result.output


@pytest.mark.parametrize("name", ["../escaped.txt", "/tmp/x", "..", "program.py", ""])
def test_a_file_name_that_is_not_plain_is_refused(name, tmp_path):
    with pytest.raises(ValueError, match=r"run_python: files\[.*a file name must be a plain name"):
        run_python("print(1)", ROOMY, files={name: "text"})
    assert files_under(tmp_path) == []


def test_without_namespaces_the_sandbox_refuses_naming_the_cause_and_the_opt_out(monkeypatch):
    monkeypatch.setattr(runner, "namespaces_problem", lambda: "`unshare --user` failed: Operation not permitted")
    with pytest.raises(SandboxUnavailable, match=r"unshare --user.*allow_unisolated=True"):
        run_python("print(1)", ROOMY)


def test_the_opt_out_runs_with_a_warning(monkeypatch):
    monkeypatch.setattr(runner, "namespaces_problem", lambda: "no namespaces in this opt-out test")
    limits = SandboxLimits(timeout_s=30.0, cpu_time_s=30, allow_unisolated=True)
    with pytest.warns(SandboxWarning, match="no namespaces in this opt-out test.*WITHOUT network"):
        result = run_python("import os\nprint(os.environ['HOME'] == os.getcwd())", limits)
    assert (result.status, result.output.strip()) == ("ok", "True")


def test_unisolated_a_deep_tree_with_locked_directories_is_still_removed(tmp_path, monkeypatch):
    """Without namespaces the program works in the host directory itself. A tree deeper
    than the recursion limit and than PATH_MAX (1,200 levels of 'deep/'), with
    directories it made unreadable, is removed: it used to raise RecursionError out of
    run_python and stay on disk."""
    monkeypatch.setattr(runner, "namespaces_problem", lambda: "no namespaces in the deep-tree test")
    limits = SandboxLimits(timeout_s=30.0, cpu_time_s=30, allow_unisolated=True)
    program = ("import os\nos.mkdir('locked')\nopen('locked/file', 'w').close()\nos.chmod('locked', 0)\n"
               "for _ in range(1200):\n    os.mkdir('deep')\n    os.chdir('deep')\n"
               "    open('file', 'w').close()\nos.chmod('.', 0o500)\nprint('made')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        result = run_python(program, limits)
    assert (result.status, result.output) == ("ok", "made\n"), result.output
    assert files_under(tmp_path) == []


def test_the_report_comes_from_the_working_directory_even_when_the_program_moves_it(tmp_path, monkeypatch):
    """Unisolated, a program may rename its own directory and leave a link to another
    in its place; the report still comes from the directory it was given."""
    monkeypatch.setattr(runner, "namespaces_problem", lambda: "no namespaces in the moved-directory test")
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "report.txt").write_text("decoy")
    program = (f"import os\nhere = os.getcwd()\nos.rename(here, here + '-moved')\nos.symlink({str(decoy)!r}, here)\n"
               "open(here + '-moved/report.txt', 'w').write('real')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        result = run_python(program, SandboxLimits(timeout_s=30.0, cpu_time_s=30, allow_unisolated=True))
    assert (result.status, result.report) == ("ok", "real"), result.output


def test_removing_a_working_directory_never_follows_a_link(tmp_path):
    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "inner" / "kept.txt").write_text("kept")
    directory = workdir.make({"given.txt": "given"})
    os.symlink(outside, os.path.join(directory, "link"))
    os.symlink(outside / "inner" / "kept.txt", os.path.join(directory, "file_link"))
    workdir.remove(directory)
    assert not os.path.exists(directory) and (outside / "inner" / "kept.txt").read_text() == "kept"


def test_the_probe_names_a_missing_tool(monkeypatch):
    def missing(name):
        raise SandboxUnavailable(f"the sandbox needs util-linux's `{name}` (apt-get install util-linux)")

    monkeypatch.setattr(isolation, "tool", missing)
    runner.namespaces_problem.cache_clear()
    try:
        assert "util-linux's `setpriv`" in runner.namespaces_problem()
    finally:
        runner.namespaces_problem.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.undo()
        assert runner.namespaces_problem() is None
