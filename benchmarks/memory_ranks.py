"""Per-rank training memory with 2 processes (gloo, CPU) and the sketch traffic per step.

``python -m benchmarks.memory --world 2`` runs this: each mode in a fresh pair of
processes, on the same 156M config as the single-process measurement, every block and the
model FSDP2-sharded over the two ranks as ``logra_fsdp`` shards them (``shard_policy``).
Each rank replays the single-process step (``harness.Runner.step``) on rollouts of its own:
2 rows of 2,048 tokens through ``backward_micro_batches`` (the loss weighted over both
ranks, as GRPOModule weights it), then the update (LoGRA: probe on its own 2 rows). Modes: dense AdamW (FSDP2 reduce-scatters the
gradients, so gradients and moments are sharded), LoRA r=256, LoGRA r=256 with
``sketch_accumulation: sharded`` (each layer's contribution reduce-scattered in backward)
and ``local`` (every row accumulated, reduce-scattered once at the step).

Memory per rank = the rank's peak RSS (``VmHWM``, reset once the sharded model is built, so
the full-model construction is not counted) minus its RSS before the model was built.
Traffic: the bytes LoGRA's sketch reductions send per rank, as ring collectives send
them (``layout.sketch_bytes_sent``), and the loopback interface's bytes over the whole
step (both ranks, everything: FSDP2's gathers, gradient reductions, sketches, the
probe's gathered directions), read on rank 0.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from .harness import ROOT, build_mode, micro_batching, optimizer_state_bytes, prompt_share, random_replay
from .model_shapes import BENCH_156M, SMOKE

MIB = 2**20
RANK_MODES = ("dense", "lora", "logra_sharded", "logra_local")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmitted bytes
    return 0


def rank_main(mode: str, tokens: int, micro_batches: int, smoke: bool = False) -> dict:
    """One rank of one mode (run under torchrun-style environment variables)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import LoGRAConfig
    from lightning_logra.strategies.sharding import shard_policy

    shape = SMOKE if smoke else BENCH_156M
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1 if smoke else max(1, (os.cpu_count() or 2) // world))
    mesh = init_device_mesh("cpu", (world,))
    prompt = prompt_share(tokens)
    settings = micro_batching(tokens - prompt)
    baseline = _status_mib("VmRSS")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    replay = random_replay(model, micro_batches, prompt, tokens - prompt, shape["vocab_size"],
                           num_generations=micro_batches, seed=1 + rank, settings=settings)
    runner = build_mode(mode.split("_")[0], model, settings, probe_responses=micro_batches, probe_max_tokens=tokens,
                        shard=lambda model: shard_policy(model, mesh, LoGRAConfig().target_modules),
                        **({"sketch_accumulation": mode.split("_")[1]} if mode.startswith("logra") else {}))
    after_build = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the unsharded construction is not counted
    phases = {}

    def end_phase(name: str) -> None:
        phases[name] = _status_mib("VmHWM") - baseline

    dist.barrier()
    loopback = _loopback_bytes()
    seconds = runner.step(replay, phase=end_phase)["step"]
    dist.barrier()
    loopback = _loopback_bytes() - loopback
    logra = runner.logra
    result = {
        "mode": mode, "rank": rank, "world": world, "peak_mib": _status_mib("VmHWM") - baseline,
        "after_build_mib": after_build - baseline, "peak_after_mib": phases, "step_seconds": seconds,
        "loopback_bytes_step": loopback,
    }
    if logra is not None:
        state = optimizer_state_bytes(runner)
        result.update(accumulation=logra.layout.accumulation, sketch_bytes_sent=logra.layout.sketch_bytes_sent,
                      sketch_buffer_mib=state["sketch_accumulator"] / MIB, scratch_mib=state["accumulation_scratch"] / MIB,
                      state_bytes=state)
    dist.destroy_process_group()
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_ranks(environment: dict, tokens: int, micro_batches: int, world: int = 2, smoke: bool = False) -> list[dict]:
    """Every mode of ``RANK_MODES`` in a fresh group of ``world`` processes; one row per rank."""
    rows = []
    for mode in RANK_MODES:
        port = _free_port()
        processes = []
        for rank in range(world):
            env = dict(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                       LOCAL_RANK=str(rank))
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.memory_ranks", "--mode", mode, "--tokens", str(tokens),
                 "--micro-batches", str(micro_batches), *(["--smoke"] if smoke else [])],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate()
            if process.returncode != 0:
                raise SystemExit(f"2-process mode {mode} rank {rank} failed:\n{stderr[-3000:]}")
            rows.append(json.loads(stdout.strip().splitlines()[-1]))
            print(f"world {world} {mode} rank {rank}: {rows[-1]['peak_mib']:,.0f} MiB", flush=True)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=RANK_MODES, required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny model (model_shapes.SMOKE)")
    args = parser.parse_args()
    print(json.dumps(rank_main(args.mode, args.tokens, args.micro_batches, args.smoke)))
