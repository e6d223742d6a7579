"""A reward worker killed at the reward timeout takes its sandboxed programs with it: the
parent-death signal ends them long before their own time limit would."""

import time

import psutil
import pytest

from lightning_logra.rewards import RewardRunner, RewardWarning
from lightning_logra.sandbox import namespaces_problem
from lightning_logra.sandbox.isolation import LAUNCHER

NAMESPACES = namespaces_problem()


def sandboxed_processes(since: float) -> list[str]:
    return [" ".join(process.info["cmdline"])[:200] for process in psutil.process_iter(["cmdline", "create_time"])
            if LAUNCHER in (process.info["cmdline"] or ()) and process.info["create_time"] >= since - 1.0]


@pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
def test_programs_of_a_killed_reward_worker_die_with_it():
    runner = RewardRunner(["lightning_logra.rewards.code:code_execution_reward"], timeout_s=1.5)
    sleeper = "```python\nimport time\ntime.sleep(2.9)\ndef f(x):\n    return x\n```"  # its limit: 3 s
    try:
        runner.start()
        started = time.time()
        with pytest.warns(RewardWarning, match="did not return within timeout_s=1.5 s"):
            runner([sleeper] * 2, tests=[["assert f(1) == 1"]] * 2)
        time.sleep(0.5)
        assert time.time() - started < 2.9  # the programs' own limit has not ended them
        assert sandboxed_processes(started) == []
    finally:
        runner.close()
