"""The issue's attacks, each as a completion scored by ``code_execution_reward``: each scores
0 within the time limit + 1 s, leaves no process and no file behind, and leaves the
training (this test's) process and its environment as they were.

Each program ends by defining the function its test checks, so it scores 1 exactly when the
attack got through (the fork bomb, the loop and the printing never get there).
"""

import os
import socket
import tempfile
import time
import uuid

import pytest

from lightning_logra.rewards.code import code_execution_reward
from lightning_logra.sandbox import SandboxLimits, namespaces_problem, runner
from tests.helpers.sandbox import files_under, processes_under

NAMESPACES = namespaces_problem()
pytestmark = pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
LIMITS = SandboxLimits(timeout_s=2.0, cpu_time_s=1)
SECRET_NAME, SECRET = "LOGRA_ATTACK_SECRET", uuid.uuid4().hex
ESCAPE = f"/tmp/logra-escaped-{uuid.uuid4().hex}"
ATTACKS = {
    "infinite_loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "allocate_10_GB": "block = bytearray(10 * 2**30)",
    "write_outside": f"open({ESCAPE!r}, 'w').write('escaped')\nopen('../escaped.txt', 'w').write('escaped')",
    "read_parent_environment": (
        "import os\n"
        f"found = os.environ.get({SECRET_NAME!r}) == {SECRET!r}\n"
        f"found = found or {SECRET!r} in open('/proc/{os.getpid()}/environ').read()\n"
        "assert found"),
    # PORT: where this test listens, so that only a missing network stops the connection.
    "socket_to_localhost": "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)",
    "print_100_MB": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\nwhile True:\n    pass",
    "kill_parent": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
    # The third round: io_uring's socket operations bypassed the filter on socket(2);
    # a nested user namespace had every capability; vsock sockets were allowed; a deep tree
    # broke the cleanup; files were capped one by one only; threads not at all.
    "io_uring": "import ctypes\nassert ctypes.CDLL(None).syscall(425, 4, ctypes.create_string_buffer(120)) >= 0",
    "nested_namespaces": "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000 | 0x40000000) == 0",
    "vsock_socket": "import socket\nsocket.socket(40, socket.SOCK_STREAM)",
    "deep_tree": "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')",
    "fill_the_disk": "for n in range(64):\n    open(f'f{n}', 'wb', buffering=0).write(b'x' * 2**20)",
    "thread_bomb": ("import threading\nthreading.stack_size(2**16)\ngate = threading.Lock()\ngate.acquire()\n"
                    "for _ in range(500):\n    threading.Thread(target=gate.acquire, daemon=True).start()"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_scores_0_in_time_and_leaves_nothing_behind(attack, tmp_path, monkeypatch):
    if attack == "thread_bomb" and runner.threads_problem(namespaces=True) is not None:
        pytest.skip(f"threads are not bounded here: {runner.threads_problem(namespaces=True)}")
    monkeypatch.setenv(SECRET_NAME, SECRET)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the working directory is made there
    environment = dict(os.environ)
    listener = socket.create_server(("127.0.0.1", 0))
    program = ATTACKS[attack].replace("PORT", str(listener.getsockname()[1]))
    completion = f"```python\n{program}\ndef f(x):\n    return x\n```"
    started = time.monotonic()
    scores = code_execution_reward([completion], tests=[["assert f(1) == 1"]], sandbox_limits=LIMITS)
    elapsed = time.monotonic() - started
    assert scores == [0.0]
    assert elapsed <= LIMITS.timeout_s + 1.0
    assert processes_under(tmp_path) == []
    assert files_under(tmp_path) == [] and not os.path.exists(ESCAPE)
    assert dict(os.environ) == environment
    listener.close()


def test_the_same_program_without_the_attack_scores_1():
    """The attacks' frame is sound: their function alone passes its test."""
    assert code_execution_reward(["```python\ndef f(x):\n    return x\n```"], tests=[["assert f(1) == 1"]],
                                 sandbox_limits=LIMITS) == [1.0]


def test_killing_its_parent_reaches_only_the_namespaces_process_1():
    """``os.getppid()`` inside is the namespace's process 1 (not the trainer), which ignores
    the signal: the program goes on and passes."""
    completion = ("```python\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                  "def f(x):\n    return x\n```")
    assert code_execution_reward([completion], tests=[["assert f(1) == 1"]], sandbox_limits=LIMITS) == [1.0]
