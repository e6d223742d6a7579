"""examples/torch_loop.py (plain torch, no Lightning) runs to its last step in a subprocess."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_plain_torch_example_runs_with_kl_control():
    completed = subprocess.run([sys.executable, str(REPO / "examples" / "torch_loop.py")], capture_output=True,
                               text=True, timeout=300, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-2000:]
    last = completed.stdout.strip().splitlines()[-1]
    assert last.startswith("step 29") and "budget" in last
