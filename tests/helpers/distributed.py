"""Run a function on 2 CPU processes over gloo and collect what each rank returns; the
environment for a `logra` subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, lightning: bool, function, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if lightning:
        # What torchrun sets: Lightning then sees externally created processes, launches
        # nothing itself, and initialises the process group from these variables.
        os.environ.update(
            WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
            LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="tests",
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results[rank] = ("ok", function(rank, world, *args))
    except BaseException:  # reported to the parent, which fails the test
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(lightning: bool, function, args) -> list:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(2, free_port(), lightning, function, args, results), nprocs=2, start_method="spawn")
    values = []
    for rank in range(2):
        status, value = results[rank]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        values.append(value)
    return values


def run_on_two_ranks(function, *args) -> list:
    """[rank 0's value, rank 1's value] of ``function(rank, world, *args)`` with the gloo
    process group initialised; any rank's exception fails with its traceback."""
    return _run(False, function, args)


def run_lightning_on_two_ranks(function, *args) -> list:
    """Like run_on_two_ranks, for functions that build a Trainer or Fabric with devices=2."""
    return _run(True, function, args)


# Set by Lightning in this process when a test builds a Trainer in-process; a child
# process that inherited them would try to serve the same rendezvous port.
RENDEZVOUS_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
)


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment for a fresh `logra` subprocess."""
    environment = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    environment.update(overrides)
    return environment


REPO = Path(__file__).resolve().parents[2]


def start_logra_fit(config: Path, cwd: Path, *arguments: str, **environment: str) -> subprocess.Popen:
    """`logra fit -c config *arguments` as a user runs it, in ``cwd``, importing this
    checkout; stdout and stderr together as text (``environment`` overrides variables)."""
    command = [str(Path(sys.executable).parent / "logra"), "fit", "-c", str(config), *arguments]
    return subprocess.Popen(command, cwd=cwd, env=child_environment(PYTHONPATH=str(REPO), **environment),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
