"""GPU rows, planned as one short device run: what fits on one GPU, and 1.5B memory and speed.

Every step here is GRPOModule's, as the harness replays it (``harness.Runner.step``):
``rl.batch.backward_micro_batches`` (chunked token log-probs, the default GRPO loss,
activation checkpointing), then ``AdamW.step()`` (dense, LoRA) or ``LoGRAOptimizer.step``
with the KL probe on the batch's rows. float32 master weights, bf16 autocast compute
(around the forward/backward and LoGRA's step, whose optimizer step GRPOModule also runs
under autocast).

Parts, in this order (each measurement in its own fresh process, so an OOM cannot leave
memory behind for the next; results are written to ``gpu.json`` after every measurement,
so a run cut short keeps what it measured):

1. **Largest RL step that fits.** One LoGRA r=256 RL step, then one dense AdamW step, on
   random-init Qwen2 configs built on the ``meta`` device and materialised on the GPU:
   ``Qwen2.5-7B``, ``Qwen2.5-14B``, ``27B-class`` (LoGRA) and ``Qwen2.5-1.5B``, 7B, 14B
   (dense), each mode in ascending size until its first OOM. The step: HF ``generate``
   rollout of 2 rows (one random prompt of ``tokens - new_tokens`` ids, ``new_tokens``
   sampled per row) scored once without grad for the rollout log-probs, then the replayed
   step on them, one row per micro-batch (LoGRA probes both). Recorded: peak
   ``torch.cuda.max_memory_allocated`` per phase (build, rollout, forward + backward,
   update: the whole optimizer step, LoGRA's probe included) and overall, or the phase
   that ran out of memory (the library's out-of-memory error names its own phase).
2. **1.5B memory.** ``Qwen2.5-1.5B`` config, dense AdamW, LoRA r=256 (peft, all seven
   projections) and LoGRA r=256, each in its own process: 2 rows of 4,096 tokens replayed,
   rollout excluded (the CPU memory benchmark's step at a realistic size).
3. **1.5B speed.** The three modes in one process replaying the same 4 rows of 4,096
   tokens (LoGRA probes all 4), the order rotating per repetition, median of 5,
   ``torch.cuda.synchronize`` around each piece.
4. **vLLM end to end.** ``logra fit`` on the quickstart config with the vLLM engine for a
   few steps on the GPU, when vLLM imports and the quickstart model is available; otherwise
   recorded as not run, with the reason.

``--budget-s`` bounds the whole run: a part that would start after it is recorded as not run.
Run it from the repository root; it needs no install (the root is on ``sys.path`` under
``python -m``):

    python -m benchmarks.gpu --out "$OUT"           # on the GPU machine (writes gpu.json and gpu.md)
    python -m benchmarks.gpu --render results/gpu.json --out results   # redraw gpu.md and gpu.png here
    python -m benchmarks.gpu --device cpu --smoke --out /tmp/gpu   # exercise every code path on a tiny model (no figures)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .harness import (MODES, ROOT, Clock, Runner, StepHooks, alternate_modes, argument_parser, build_mode, code_version,
                      command_line, load_json, machine_info, machine_line, micro_batching, optimizer_state_bytes, pyplot,
                      random_replay, random_token_rows, replay_rollouts, run_module, save_figure, save_json, step_line,
                      summarise, write_outputs)
from .model_shapes import QWEN_SHAPES, SMOKE

if TYPE_CHECKING:  # for the annotations; the functions import torch where they use it
    import torch

FIT_SIZES = {"logra": ("Qwen2.5-7B", "Qwen2.5-14B", "27B-class"), "dense": ("Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen2.5-14B")}
FIT_TOKENS, FIT_NEW_TOKENS, FIT_MICRO_BATCHES = 2048, 64, 2
SIZE_SHAPE, SIZE_TOKENS, MEMORY_MICRO_BATCHES, SPEED_MICRO_BATCHES, SPEED_REPS = "Qwen2.5-1.5B", 4096, 2, 4, 5
SIZE_PROMPT = 512  # prompt tokens of the replayed 1.5B rows (the rest completion)
STEP_PHASES = ("build", "rollout", "forward_backward", "update")
STEP = ("GRPOModule's step (`rl.step.run_update`: `backward_micro_batches`, one row per micro-batch, loss `grpo`, then `AdamW.step()` or "
        "`LoGRAOptimizer.step` probing every row), on generated rollouts (fit) or replayed random rows (1.5B memory and speed).")
GIB = 2**30


# --- one process: build a model and run steps ------------------------------------------

def build_model(shape: dict, device: "torch.device"):
    """A random-init Qwen2 built on the meta device and materialised on ``device`` in float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = Qwen2Config(**shape, attn_implementation="sdpa")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the head and the embeddings separate tensors
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("the materialised model's head is not tied to its embeddings")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, config.initializer_range)
            elif name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.zero_()
    # to_empty leaves non-persistent buffers (the rotary frequencies) uninitialised.
    model.model.rotary_emb = Qwen2RotaryEmbedding(config).to(device)
    model.generation_config.eos_token_id = None  # random weights: always generate new_tokens
    model.generation_config.pad_token_id = 0
    return model


def device_hooks(device: "torch.device") -> StepHooks:
    """bf16 autocast compute over float32 master weights; on CUDA, every clock read waits
    for the device's queue."""
    import functools

    import torch

    synchronize = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else (lambda: None)
    return StepHooks(context=functools.partial(torch.autocast, device.type, dtype=torch.bfloat16), synchronize=synchronize)


def make_runner(mode: str, shape: dict, device: "torch.device", tokens: int, micro_batches: int, settings,
                state: dict | None = None) -> Runner:
    """``mode`` on a fresh model of ``shape`` (with ``state``'s weights, if given). LoGRA
    probes every row of a step at full length, as this script always has: both set
    explicitly (the library's defaults probe 2 rows of at most 4,096 tokens)."""
    import torch

    model = build_model(shape, device)
    if state is not None:
        model.load_state_dict(state)
    return build_mode(mode, model, settings, probe_responses=micro_batches, probe_max_tokens=tokens,
                      compute_dtype=torch.bfloat16, hooks=device_hooks(device))


def replay_random(runner: Runner, shape: dict, rows: int, tokens: int, seed: int):
    """The replayed batch of ``rows`` random rows (``SIZE_PROMPT`` prompt tokens at most, one
    prompt per group of all the rows), scored by the runner's model."""
    prompt = min(SIZE_PROMPT, tokens // 8)
    return random_replay(runner.model, rows, prompt, tokens - prompt, shape["vocab_size"], num_generations=rows,
                         seed=seed, settings=runner.settings, context=runner.hooks.context)


def rollout(runner: Runner, rows: int, prompt_tokens: int, new_tokens: int, seed: int):
    """``rows`` rows of one random prompt, then ``new_tokens`` sampled by HF ``generate``,
    scored once without grad (the rollout log-probs) as a replayable batch."""
    import torch

    model = runner.model
    device = next(model.parameters()).device
    prompts = random_token_rows(rows, prompt_tokens, 0, model.config.vocab_size, num_generations=rows, seed=seed).to(device)
    model.eval()
    with torch.no_grad(), runner.hooks.context():
        sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.train()
    return replay_rollouts(model, sequences, prompt_tokens, num_generations=rows, seed=seed, settings=runner.settings,
                           context=runner.hooks.context)


class PeakMemory:
    """Peak allocated GPU memory per phase (None on CPU, where the smoke run only checks paths)."""

    def __init__(self, device):
        import torch

        self.device, self.phases = device, {}
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def allocated_gib(self) -> float | None:
        import torch

        return torch.cuda.memory_allocated(self.device) / GIB if self.cuda else None

    def end_phase(self, name: str) -> None:
        import torch

        if self.cuda:
            self.phases[name] = torch.cuda.max_memory_allocated(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.phases[name] = None

    def peak_gib(self) -> float | None:
        return max(self.phases.values()) if self.cuda and self.phases else None


def child_fit(mode: str, shape: dict, tokens: int, new_tokens: int, micro_batches: int, device) -> dict:
    """One RL step (rollout + update) of ``mode``; the peak memory of each phase."""
    import torch

    torch.manual_seed(0)
    memory = PeakMemory(device)
    result = {"phases_gib": memory.phases}
    try:
        runner = make_runner(mode, shape, device, tokens, micro_batches, micro_batching(new_tokens))
        memory.end_phase("build")
        result["weights_gib"] = memory.allocated_gib()
        result["parameters"] = sum(p.numel() for p in runner.model.parameters())
        clock = Clock(runner.hooks.synchronize)
        replay = rollout(runner, micro_batches, tokens - new_tokens, new_tokens, seed=0)
        result["rollout_s"] = clock.lap()
        memory.end_phase("rollout")
        result["step_s"] = runner.step(replay, phase=memory.end_phase)
        result["fits"] = True
    except torch.OutOfMemoryError as error:
        result["fits"] = False
        result["oom_in_phase"] = next(p for p in STEP_PHASES if p not in memory.phases)
        result["oom_message"] = str(error).splitlines()[0][:600]
    result["peak_gib"] = memory.peak_gib()
    return result


def child_memory(mode: str, shape: dict, tokens: int, micro_batches: int, device) -> dict:
    """One training step of ``mode`` on replayed random rows (rollout excluded), with a breakdown."""
    import torch

    torch.manual_seed(0)
    memory = PeakMemory(device)
    runner = make_runner(mode, shape, device, tokens, micro_batches, micro_batching(tokens - min(SIZE_PROMPT, tokens // 8)))
    replay = replay_random(runner, shape, micro_batches, tokens, seed=1)
    memory.end_phase("build")
    seconds = runner.step(replay, phase=memory.end_phase)
    model = runner.model
    step_phases = {k: v for k, v in memory.phases.items() if k != "build"}
    return {
        "mode": mode,
        "peak_gib": max(step_phases.values()) if memory.cuda else None,
        "phases_gib": memory.phases,
        "breakdown_gib": {
            "weights": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB,
            "gradients (fp32, as many as trainable parameters)":
                sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) / GIB,
            "optimizer_or_logra_state": optimizer_state_bytes(runner)["total"] / GIB,
        },
        "step_s": seconds,
    }


def child_speed(shape: dict, tokens: int, micro_batches: int, reps: int, device) -> dict:
    """The three modes from the same weights on the same replayed rows, order rotating per repetition."""
    import torch

    torch.manual_seed(0)
    state = build_model(shape, device).state_dict()
    settings = micro_batching(tokens - min(SIZE_PROMPT, tokens // 8))
    runners = {mode: make_runner(mode, shape, device, tokens, micro_batches, settings, state) for mode in MODES}
    del state
    replay = replay_random(runners["dense"], shape, micro_batches, tokens, seed=2)  # dense: the plain model
    run = alternate_modes(runners, replay, reps)
    return summarise(run["samples"], run["contention"])


def run_child(arguments: dict) -> dict:
    import torch

    device = torch.device(arguments["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as any bf16 trainer runs its float32 leftovers
    kind = arguments.pop("kind")
    arguments["device"] = device
    return {"child_fit": child_fit, "child_memory": child_memory, "child_speed": child_speed}[kind](**arguments)


# --- the parent: run the parts in fresh processes, write as it goes ----------------------

class Run:
    def __init__(self, out: Path, device: str, smoke: bool, budget_s: float):
        self.out, self.device, self.smoke = out, device, smoke
        self.deadline = time.monotonic() + budget_s
        self.result = {"command": command_line("gpu"), "machine": machine_info(), "code": code_version(),
                       "device": device_name(device), "device_memory_gib": device_memory_gib(device), "smoke": smoke,
                       "step": STEP, "fit": [], "memory_1.5b": [], "speed_1.5b": None, "vllm": None, "not_run": []}
        # A tiny model's many small ops run fastest on one CPU thread.
        self.environment = dict(os.environ, **({"OMP_NUM_THREADS": "1"} if smoke and device == "cpu" else {}))

    def shape(self, name: str) -> dict:
        # The smoke model ties its head as the named config does.
        return dict(SMOKE, tie_word_embeddings=QWEN_SHAPES[name]["tie_word_embeddings"]) if self.smoke else QWEN_SHAPES[name]

    def save(self) -> None:
        save_json(self.out / "gpu.json", self.result)
        (self.out / "gpu.md").write_text(render(self.result) + "\n")

    def child(self, label: str, arguments: dict, timeout_s: float) -> dict | None:
        left = self.deadline - time.monotonic()
        if left < 20:
            self.result["not_run"].append(f"{label}: time budget spent")
            return None
        print(f"[gpu] {label} ...", flush=True)
        started = time.perf_counter()
        try:
            completed = run_module("gpu", ["--child", json.dumps(arguments)], env=self.environment, capture_output=True,
                                   text=True, timeout=min(timeout_s, left))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {min(timeout_s, left):.0f} s", "seconds": time.perf_counter() - started}
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode != 0 or not lines:
            return {"error": f"exit {completed.returncode}: {completed.stderr.strip()[-1500:]}", "seconds": time.perf_counter() - started}
        result = json.loads(lines[-1][len("RESULT "):])
        result["seconds"] = time.perf_counter() - started
        print(f"[gpu] {label}: {summary(result)}", flush=True)
        return result

    def fit(self) -> None:
        tokens, new_tokens = (64, 8) if self.smoke else (FIT_TOKENS, FIT_NEW_TOKENS)
        for mode in ("logra", "dense"):
            for name in FIT_SIZES[mode]:
                result = self.child(f"fit {mode} {name}", {"kind": "child_fit", "mode": mode, "shape": self.shape(name), "tokens": tokens,
                                                           "new_tokens": new_tokens, "micro_batches": FIT_MICRO_BATCHES,
                                                           "device": self.device}, timeout_s=300)
                if result is None:
                    break
                self.result["fit"].append({"mode": mode, "model": name, "tokens": tokens, "new_tokens": new_tokens, **result})
                self.save()
                if not result.get("fits"):
                    break  # larger sizes will not fit either

    def memory(self) -> None:
        tokens = 64 if self.smoke else SIZE_TOKENS
        for mode in MODES:
            result = self.child(f"memory {mode} {SIZE_SHAPE}", {"kind": "child_memory", "mode": mode, "shape": self.shape(SIZE_SHAPE),
                                                                  "tokens": tokens, "micro_batches": MEMORY_MICRO_BATCHES,
                                                                  "device": self.device}, timeout_s=180)
            if result is not None:
                self.result["memory_1.5b"].append({"tokens": tokens, **result})
                self.save()

    def speed(self) -> None:
        tokens, reps = (64, 2) if self.smoke else (SIZE_TOKENS, SPEED_REPS)
        result = self.child(f"speed {SIZE_SHAPE}", {"kind": "child_speed", "shape": self.shape(SIZE_SHAPE), "tokens": tokens,
                                                     "micro_batches": SPEED_MICRO_BATCHES, "reps": reps, "device": self.device},
                            timeout_s=240)
        if result is not None:
            self.result["speed_1.5b"] = {"tokens": tokens, "reps": reps, **result}
            self.save()

    def vllm(self) -> None:
        import importlib.util

        from lightning_logra.models import BUILTIN_MODELS

        missing = [name for name in ("vllm", BUILTIN_MODELS["smollm2-135m-instruct"].package, "gguf", "accelerate")
                   if importlib.util.find_spec(name) is None]
        if missing or self.device == "cpu":
            self.result["vllm"] = {"run": False, "reason": f"not importable here: {', '.join(missing)}" if missing else "needs a GPU"}
            self.save()
            return
        left = self.deadline - time.monotonic()
        if left < 120:
            self.result["not_run"].append("vllm: time budget spent")
            return
        arguments = ["fit", "-c", "configs/quickstart.yaml", "--trainer.accelerator=cuda", "--trainer.precision=bf16-mixed",
                     "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--model.rollout.engine=vllm",
                     "--model.rollout.gpu_memory_utilization=0.3", f"--trainer.default_root_dir={self.out / 'vllm_run'}"]
        started = time.perf_counter()
        try:
            completed = subprocess.run([sys.executable, "-c", "from lightning_logra.cli import main; main()", *arguments], cwd=ROOT,
                                       capture_output=True, text=True, timeout=left - 10)
            self.result["vllm"] = {"run": True, "exit": completed.returncode, "seconds": time.perf_counter() - started,
                                   "command": "logra " + " ".join(arguments), "output_tail": (completed.stdout + completed.stderr)[-3000:]}
        except subprocess.TimeoutExpired:
            self.result["vllm"] = {"run": True, "exit": None, "seconds": time.perf_counter() - started, "reason": "timed out"}
        self.save()


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).name
    return "cpu"


def device_memory_gib(device: str) -> float | None:
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB if device.startswith("cuda") else None


def summary(result: dict) -> str:
    if "error" in result:
        return result["error"].splitlines()[-1]
    if "fits" in result:
        return "OOM in " + result["oom_in_phase"] if not result["fits"] else f"fits, peak {result['peak_gib']} GiB"
    if "medians_s" in result:
        return f"LoGRA / dense {result['logra_over_dense']:.3f}"
    return f"peak {result['peak_gib']} GiB"


def gib(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(result: dict) -> str:
    memory = f", {result['device_memory_gib']:.1f} GiB" if result["device_memory_gib"] else ""
    lines = [f"Device: {result['device']}{memory}. {machine_line(result['machine'])}; command: `{result['command']}`."]
    if result["smoke"]:
        lines.append("**Smoke run on a tiny model: no figure here is a measurement of the configs named.**")
    lines.append(f"Step: {step_line(result)}")
    lines += ["", "### Largest RL step on one device (rollout + update, float32 master weights, bf16 compute)", "",
              "Peak GiB per phase; update is the whole optimizer step (LoGRA: prepare, KL probe, apply).", "",
              "| mode | model | parameters | fits | peak GiB | build | rollout | forward + backward | update | step s |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["fit"]:
        if "error" in row:
            lines.append(f"| {row['mode']} | {row['model']} | | error: {row['error'].splitlines()[-1][:120]} | | | | | | |")
            continue
        phases = row["phases_gib"]
        fits = "yes" if row["fits"] else f"**OOM** ({row['oom_in_phase']})"
        step = row.get("step_s", {}).get("step")
        lines.append(f"| {row['mode']} | {row['model']} | {row.get('parameters', 0) / 1e9:.2f}B | {fits} | {gib(row['peak_gib'])} | "
                     + " | ".join(gib(phases.get(p)) for p in STEP_PHASES) + f" | {'-' if step is None else f'{step:.1f}'} |")
    for row in result["fit"]:
        if row.get("oom_message"):
            lines.append(f"\n{row['mode']} {row['model']}: {row['oom_message']}")
    for mode in ("logra", "dense"):
        fitting = [row["model"] for row in result["fit"] if row["mode"] == mode and row.get("fits")]
        lines.append(f"\nLargest {mode} step that fits: {fitting[-1] if fitting else 'none measured'}.")
    lines += ["", f"### {SIZE_SHAPE}: memory of one training step ({MEMORY_MICRO_BATCHES} micro-batches, rollout excluded)", "",
              "| mode | tokens | peak GiB | weights GiB | gradients GiB | optimizer / LoGRA state GiB | step s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["memory_1.5b"]:
        if "error" in row:
            lines.append(f"| {row.get('mode', '?')} | | error: {row['error'].splitlines()[-1][:120]} | | | | |")
            continue
        b = list(row["breakdown_gib"].values())
        lines.append(f"| {row['mode']} | {row['tokens']} | {gib(row['peak_gib'])} | {b[0]:.2f} | {b[1]:.2f} | {b[2]:.2f} | {row['step_s']['step']:.2f} |")
    peaks = {row["mode"]: row["peak_gib"] for row in result["memory_1.5b"] if row.get("peak_gib")}
    if {"dense", "lora", "logra"} <= peaks.keys():
        lines.append(f"\nLoGRA / dense AdamW = **{peaks['logra'] / peaks['dense']:.3f}**, LoGRA / LoRA-r256 = **{peaks['logra'] / peaks['lora']:.3f}**.")
    speed = result["speed_1.5b"]
    if speed and "medians_s" in speed:
        lines += ["", f"### {SIZE_SHAPE}: train-step time ({SPEED_MICRO_BATCHES} micro-batches of {speed['tokens']} tokens, median of {speed['reps']})", "",
                  "| mode | forward + backward s | update s | KL probe s | step s |", "|---|---:|---:|---:|---:|"]
        for mode in MODES:
            m = speed["medians_s"][mode]
            lines.append(f"| {mode} | {m['forward_backward']:.3f} | {m['update']:.3f} | {m['kl_probe']:.3f} | {m['step']:.3f} |")
        lines.append(f"\nLoGRA / dense = **{speed['logra_over_dense']:.3f}** ({speed['logra_over_dense_without_probe']:.3f} without the probe); "
                     f"LoGRA / LoRA = {speed['logra_over_lora']:.3f}; probe share {100 * speed['probe_share_of_logra_step']:.0f}%.")
    elif speed:
        lines.append(f"\nSpeed: error: {speed['error'].splitlines()[-1][:200]}")
    vllm = result["vllm"]
    if vllm:
        lines.append("\n### vLLM end to end\n\n" + (f"Not run: {vllm['reason']}." if not vllm["run"] else
                     f"`{vllm.get('command', '')}`: exit {vllm.get('exit')}, {vllm['seconds']:.0f} s."))
    if result["not_run"]:
        lines.append("\nNot run: " + "; ".join(result["not_run"]) + ".")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.2))
    rows = [row for row in result["fit"] if "phases_gib" in row]
    labels = [f"{row['mode']}\n{row['model']}" for row in rows]
    axis.bar(labels, [(row["peak_gib"] or 0.0) if row["fits"] else 0.0 for row in rows], label="peak GiB (fits)")
    for index, row in enumerate(rows):
        if not row["fits"]:
            axis.text(index, 1, f"OOM\n({row['oom_in_phase']})", ha="center", va="bottom", color="red", fontsize=8)
    if result["device_memory_gib"]:
        axis.axhline(result["device_memory_gib"], color="gray", linestyle="--", label="device memory")
    axis.set_ylabel("peak torch.cuda.max_memory_allocated, GiB")
    axis.set_title(f"One RL step on {result['device']}, {result['machine']['date_utc'][:10]}: {result['command']}", fontsize=8)
    save_figure(figure, path)


def main() -> None:
    parser = argument_parser(__doc__, render_help="only redraw gpu.md and gpu.png (in --out) from a results file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="a tiny model for every config: checks the code paths, measures nothing")
    parser.add_argument("--budget-s", type=float, default=540.0, help="parts that would start later are recorded as not run")
    parser.add_argument("--parts", nargs="+", default=["fit", "memory", "speed", "vllm"], choices=["fit", "memory", "speed", "vllm"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    if args.render:
        write_outputs(args.out / "gpu", load_json(args.render), render, plot)
        return
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here (use --device cpu --smoke to check the script)")
    elif not args.smoke:
        parser.error("the GPU rows need a GPU; on CPU only --smoke runs")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    run = Run(args.out, args.device, args.smoke, args.budget_s)
    for part in args.parts:
        getattr(run, part)()
    run.save()
    print(render(run.result))


if __name__ == "__main__":
    main()
