"""Training memory of one RL step: dense AdamW vs LoRA r=256 vs LoGRA r=256.

Each mode runs in its own fresh process. One step = 2 micro-batches of 2,048 tokens
(forward with chunked token log-probs, a policy-gradient loss, backward with activation
checkpointing) then the optimizer step; for LoGRA also the KL probe on the two sequences.
Rollout generation is excluded. The model is fixed before measuring: a random-init Qwen2
architecture, hidden 1024, intermediate 2816, 8 layers, 16 heads, 4 KV heads, vocabulary
32000, untied embeddings (about 156M parameters), float32.

Training memory (CPU) = the process's peak RSS minus its RSS just before the model is
built. The breakdown counts tensor bytes: weights, gradients, optimizer state, LoGRA state;
activations and other temporaries are the rest of the peak.

    python benchmarks/memory.py            # all three modes, writes results/memory.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODES = ("dense", "lora", "logra")
MIB = 2**20
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
TOKENS, MICRO_BATCHES, RANK = 2048, 2, 256


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / MIB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def run_mode(mode: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_logra import LoGRAConfig, LoGRAOptimizer, kl_step_scale, probe_predicted_kl
    from lightning_logra.modules.logprobs import sequence_logprobs

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CONFIG["vocab_size"], (1, TOKENS), generator=generator) for _ in range(MICRO_BATCHES)]
    advantages = torch.randn(MICRO_BATCHES, generator=generator)
    baseline = rss_mib()

    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    logra = None
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LoGRAConfig().target_modules)))
    if mode == "logra":
        logra = LoGRAOptimizer(model, LoGRAConfig(rank=RANK))
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, betas=(0.9, 0.95))

    started = time.perf_counter()
    for batch, advantage in zip(batches, advantages):
        mask = torch.ones_like(batch)
        logprobs = sequence_logprobs(model, batch, mask, chunk_size=1024)
        loss = -(advantage * logprobs).mean() / MICRO_BATCHES  # REINFORCE-shaped loss
        loss.backward()
    gradients = tensor_mib(p.grad for p in model.parameters() if p.grad is not None)
    if logra is None:
        optimizer.step()
        optimizer_state = tensor_mib(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        logra_state = 0.0
    else:
        logra.prepare_update(normalization_tokens=TOKENS * MICRO_BATCHES)
        input_ids = torch.cat(batches)
        logits_mask = torch.ones_like(input_ids, dtype=torch.bool)
        logits_mask[:, -1] = False
        prediction = probe_predicted_kl(model, logra.probe_layers(), input_ids, torch.ones_like(input_ids), logits_mask)
        logra.step(alpha=kl_step_scale(prediction, budget=2e-4))
        optimizer_state = 0.0
        logra_state = tensor_mib([logra.sketches.buffer] + [s.projection for s in logra.sketches] + [s.second_moment for s in logra.sketches])
    seconds = time.perf_counter() - started
    weights = tensor_mib(model.parameters())
    peak = peak_rss_mib() - baseline
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)
        if logra is None else sum(s.weight.numel() for s in logra.sketches),
        "training_memory_mib": peak,
        "breakdown_mib": {
            "weights": weights,
            "gradients": gradients,
            "optimizer_state": optimizer_state,
            "logra_state": logra_state,
            "activations_and_temporaries": peak - weights - gradients - optimizer_state - logra_state,
        },
        "step_seconds": seconds,
    }


def render(result: dict) -> str:
    rows = {row["mode"]: row for row in result["modes"]}
    lines = [
        "| mode | training memory MiB | weights | gradients | optimizer state | LoGRA state | activations + temporaries | step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row = rows[mode]
        b = row["breakdown_mib"]
        lines.append(
            f"| {mode} | {row['training_memory_mib']:,.0f} | {b['weights']:,.0f} | {b['gradients']:,.0f} | "
            f"{b['optimizer_state']:,.0f} | {b['logra_state']:,.0f} | {b['activations_and_temporaries']:,.0f} | {row['step_seconds']:.1f} |"
        )
    logra = rows["logra"]["training_memory_mib"]
    lines += [
        "",
        f"LoGRA / dense AdamW = {logra / rows['dense']['training_memory_mib']:.3f} (target <= 0.40); "
        f"LoGRA / LoRA-r256 = {logra / rows['lora']['training_memory_mib']:.3f} (target <= 0.50).",
        "",
        f"Machine: {result['machine']['processor']}, {result['machine']['cpus']} CPUs, torch {result['machine']['torch']}, "
        f"{result['machine']['date_utc']}; model {CONFIG}; {MICRO_BATCHES} x {TOKENS} tokens.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ("weights", "gradients", "optimizer_state", "logra_state", "activations_and_temporaries")
    rows = {row["mode"]: row for row in result["modes"]}
    figure, axis = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(MODES)
    for part in parts:
        values = [rows[mode]["breakdown_mib"][part] / 1024 for mode in MODES]
        axis.bar(MODES, values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("GiB (peak RSS above the pre-model baseline)")
    axis.set_title(f"One RL step, 156M Qwen2 config, {MICRO_BATCHES} x {TOKENS} tokens (CPU, {result['machine']['date_utc'][:10]})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process and print its JSON")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode)))
        return
    import torch

    modes = []
    for mode in MODES:
        completed = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
        modes.append(json.loads(completed.stdout.strip().splitlines()[-1]))
        print(f"{mode}: {modes[-1]['training_memory_mib']:,.0f} MiB", flush=True)
    result = {
        "benchmark": "training memory of one RL step (rollout excluded), each mode in a fresh process",
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": __import__("os").cpu_count(),
                    "torch": torch.__version__, "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "model": CONFIG, "tokens_per_micro_batch": TOKENS, "micro_batches": MICRO_BATCHES, "rank": RANK,
        "modes": modes,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "memory.md").write_text(render(result) + "\n")
    plot(result, RESULTS / "memory.png")
    print(render(result))


if __name__ == "__main__":
    main()
