"""Run a function on 2 CPU processes over gloo and collect what rank 0 returns."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, function, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        value = function(rank, world, *args)
        results[rank] = ("ok", value)
    except BaseException:  # reported to the parent, which fails the test
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(function, *args):
    """Returns [rank 0's value, rank 1's value]; any rank's exception fails with its traceback."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(2, _free_port(), function, args, results), nprocs=2, start_method="spawn")
    values = []
    for rank in range(2):
        status, value = results[rank]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        values.append(value)
    return values


def _lightning_worker(rank: int, world: int, port: int, function, args, results) -> None:
    # What torchrun sets: Lightning then sees externally created processes, launches
    # nothing itself, and initialises the process group from these variables.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="tests",
    )
    torch.set_num_threads(1)
    try:
        results[rank] = ("ok", function(rank, world, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_lightning_on_two_ranks(function, *args):
    """Like run_on_two_ranks, for functions that build a Trainer or Fabric with devices=2."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_lightning_worker, args=(2, _free_port(), function, args, results), nprocs=2, start_method="spawn")
    values = []
    for rank in range(2):
        status, value = results[rank]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        values.append(value)
    return values
