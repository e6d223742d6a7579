"""What every script records and writes: the machine, the code, analytic memory rows, the
command line, JSON results and their rendered .md and .png."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from ..model_shapes import QWEN_SHAPES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# The step every result written before this harness was measured with.
OLD_STEP = ("the benchmarks' own earlier RL step, not GRPOModule's (`common.Runner.step`, and memory_ledger.py's copy of "
            "it: a REINFORCE-shaped loss on random tokens, every position trained, one sequence per micro-batch, the KL "
            "probe on whole sequences); to be rerun with the harness's replayed GRPO step.")


# --- the machine, the code, analytic rows -------------------------------------------------------

def machine_info() -> dict:
    """The machine a result was measured on: processor, cpus, torch, date_utc (what
    ``machine_line`` prints), and the details behind them."""
    import torch

    processor = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"processor": processor, "cpus": os.cpu_count(), "torch": torch.__version__,
            "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "platform": platform.platform(),
            "mkl": torch.backends.mkl.is_available()}
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def status_kib(field: str) -> int:
    """A field of this process's ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def machine_line(machine: dict) -> str:
    """The machine as the results tables name it (also from results that named its fields
    cpu_model / logical_cpus / torch_version)."""
    processor = machine.get("processor", machine.get("cpu_model"))
    cpus = machine.get("cpus", machine.get("logical_cpus"))
    torch_version = machine.get("torch", machine.get("torch_version"))
    return f"Machine: {processor}, {cpus} CPUs, torch {torch_version}, {machine['date_utc']}"


def cpu_caption(machine: dict) -> str:
    """``CPU (N cores), YYYY-MM-DD`` for figure titles."""
    return f"CPU ({machine.get('cpus', machine.get('logical_cpus'))} cores), {machine['date_utc'][:10]}"


def code_version() -> dict:
    """The commit the library was loaded from, and whether lightning_logra/ had local edits."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "lightning_logra"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        return {"git_commit": commit, "lightning_logra_locally_modified": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "lightning_logra_locally_modified": None}


def code_line(code: dict | None) -> str:
    if not code:
        return ""
    return f"Code: commit {str(code.get('git_commit'))[:10]}{' + local edits' if code.get('lightning_logra_locally_modified') else ''}."


def step_line(entry: dict) -> str:
    """Which step a result (or a row of one) measured: its ``step`` field, or ``OLD_STEP``
    for results written before the harness."""
    return entry.get("step", OLD_STEP)


def meta_memory_rows(names=None, world_sizes=(1, 8)) -> list[dict]:
    """``memory_report`` of each ``model_shapes.QWEN_SHAPES`` entry in ``names`` (default:
    all), built on the meta device, at each world size: the model, its parameter count and
    the report's fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import memory_report

    rows = []
    for name in names or QWEN_SHAPES:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPES[name]))
        parameters = sum(p.numel() for p in model.parameters())
        for world in world_sizes:
            local = memory_report(model, world_size=world, sketch_accumulation="local")
            rows.append({"model": name, "parameters": parameters, **memory_report(model, world_size=world).as_dict(),
                         "logra_state_local_bytes": local.logra_state_bytes})
        del model
    return rows


# --- command line and outputs --------------------------------------------------------------------

def argument_parser(doc: str, render_help: str = "measure nothing: rewrite the .md (and .png) from a results file") -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, ``--render JSON`` and ``--out DIR``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", type=Path, metavar="JSON", help=render_help)
    parser.add_argument("--out", type=Path, default=RESULTS, metavar="DIR",
                        help="folder for the .json/.md/.png (default benchmarks/results)")
    return parser


def check_smoke_out(parser: argparse.ArgumentParser, args) -> None:
    """A ``--smoke`` run measures nothing: it must not overwrite the committed results."""
    if getattr(args, "smoke", False) and args.out.resolve() == RESULTS.resolve():
        parser.error("--smoke needs --out DIR: a smoke run must not overwrite benchmarks/results")


def command_line(module: str) -> str:
    """How this run was started, as the results record it."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *sys.argv[1:]])  # quoted: it can be run again


def run_module(module: str, arguments: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<module> <arguments>`` in a fresh process, from the
    repository root (where ``benchmarks`` and, uninstalled, ``lightning_logra`` import)."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *arguments], cwd=ROOT, **kwargs)


def save_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def write_outputs(stem: Path, result: dict, render: Callable[[dict], str], plot: Callable[[dict, Path], None] | None) -> None:
    """``stem``.md (the rendered tables) and ``stem``.png (where matplotlib is installed:
    the ``bench`` extra); the tables printed."""
    import importlib.util

    stem.parent.mkdir(parents=True, exist_ok=True)
    table = render(result)
    stem.with_suffix(".md").write_text(table + "\n")
    print(table)
    if plot is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): {stem.name}.png not drawn", file=sys.stderr)
        return
    plot(result, stem.with_suffix(".png"))


def stacked_bars(axis, labels: list[str], parts: dict[str, list[float]]) -> None:
    """One bar per label, stacked from ``parts`` (legend name -> one value per label)."""
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        axis.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]


def save_figure(figure, path: Path, title: str | None = None, legend_fontsize: int = 8) -> None:
    """A legend on every axis that labels something, the title (small), tight layout, PNG at 90 dpi."""
    import matplotlib.pyplot as plt

    for axis in figure.axes:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=legend_fontsize)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
