"""Train-step time: dense AdamW vs LoRA r=256 vs LoGRA r=256 on one model, one process.

The memory benchmark's setting (``model_shapes.BENCH_156M``, float32, activation
checkpointing and chunked log-probs in every mode, a REINFORCE-shaped loss). One step =
forward + backward over 4 micro-batches of one sequence each, then the update: AdamW
``step`` + ``zero_grad`` (dense, LoRA), or LoGRA's ``prepare_update``, KL probe on 2 of the
step's sequences (the default ``probe_responses``) and ``step``. The three modes start from
the same weights and see the same tokens. Each repetition runs the three steps back to
back, in an order that rotates from one repetition to the next, so drift and order
effects fall on every mode alike; an untimed warm-up (one micro-batch and an update) per
mode comes first. Pieces
are timed with ``time.perf_counter`` (CPU ops are synchronous). Reported: medians over the
repetitions, every sample, LoGRA / dense and LoGRA / LoRA of the median step (with and
without the probe) and the probe's share of LoGRA's step.

    python benchmarks/speed.py                   # 2,048 tokens per micro-batch, 5 repetitions
    python benchmarks/speed.py --tokens 2048 8192
    python benchmarks/speed.py --tokens 8192 --add   # append a row to the existing results

A row added with ``--add`` keeps its own command, machine and date; its ratios, like every
row's, come from modes timed side by side in that one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import machine_info, machine_line, stacked_bars  # noqa: E402
from model_shapes import BENCH_156M  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("dense", "lora", "logra")
MICRO_BATCHES, RANK, PROBE_RESPONSES = 4, 256, 2
TARGET = 0.70  # LoGRA / dense


class Runner:
    """One mode's model and optimizer; ``step`` runs and times one training step."""

    def __init__(self, mode: str, state: dict):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from lightning_logra import LoGRAConfig, LoGRAOptimizer

        self.mode = mode
        model = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M))
        model.load_state_dict(state)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LoGRAConfig().target_modules)))
        self.model = model
        if mode == "logra":
            self.logra = LoGRAOptimizer(model, LoGRAConfig(rank=RANK))
        else:
            self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, betas=(0.9, 0.95))

    def step(self, batches: list[torch.Tensor], advantages: torch.Tensor) -> dict[str, float]:
        from lightning_logra import kl_step_scale, probe_predicted_kl
        from lightning_logra.modules.logprobs import sequence_logprobs

        times = {"forward_backward": 0.0, "update": 0.0, "kl_probe": 0.0}
        for batch, advantage in zip(batches, advantages):
            started = time.perf_counter()
            logprobs = sequence_logprobs(self.model, batch, torch.ones_like(batch))
            (-(advantage * logprobs).mean() / len(batches)).backward()
            times["forward_backward"] += time.perf_counter() - started
        started = time.perf_counter()
        if self.mode == "logra":
            self.logra.prepare_update(normalization_tokens=sum(b.numel() for b in batches))
            times["update"] += time.perf_counter() - started
            started = time.perf_counter()
            probe = torch.cat(batches[:PROBE_RESPONSES])
            logits_mask = torch.ones_like(probe, dtype=torch.bool)
            logits_mask[:, -1] = False
            prediction = probe_predicted_kl(self.model, self.logra.probe_layers(), probe, torch.ones_like(probe), logits_mask)
            times["kl_probe"] = time.perf_counter() - started
            started = time.perf_counter()
            self.logra.step(alpha=kl_step_scale(prediction, budget=2e-4))
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        times["update"] += time.perf_counter() - started
        times["step"] = sum(times.values())
        return times


def measure_tokens(tokens: int, reps: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    state = Qwen2ForCausalLM(Qwen2Config(**BENCH_156M)).state_dict()
    runners = {mode: Runner(mode, state) for mode in MODES}
    del state
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[list[torch.Tensor], torch.Tensor]:
        return ([torch.randint(0, BENCH_156M["vocab_size"], (1, tokens), generator=generator) for _ in range(MICRO_BATCHES)],
                torch.randn(MICRO_BATCHES, generator=generator))

    samples = alternate_modes(runners, batch, reps, label=f"{tokens} tokens")
    return {"tokens_per_micro_batch": tokens, **summarise_samples(samples)}


def alternate_modes(runners: dict, batch, reps: int, label: str | None = None) -> dict[str, list[dict]]:
    """Each runner's ``step`` samples over ``reps`` repetitions, on the same inputs per repetition.

    An untimed warm-up (the first micro-batch of one ``batch()`` and an update) per mode comes
    first; then every repetition draws fresh inputs and runs the modes in an order that rotates
    by one, so drift and order effects fall on every mode alike.
    """
    modes = tuple(runners)
    warmup_batches, warmup_advantages = batch()
    for mode in modes:  # first-call costs, not timed
        runners[mode].step(warmup_batches[:1], warmup_advantages[:1])
    samples = {mode: [] for mode in modes}
    for rep in range(reps):
        inputs = batch()
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            samples[mode].append(runners[mode].step(*inputs))
            if label:
                print(f"[{label}] rep {rep + 1}/{reps} {mode}: {samples[mode][-1]['step']:.1f} s", flush=True)
    return samples


def summarise_samples(samples: dict[str, list[dict]]) -> dict:
    """Every sample, the per-piece medians, and LoGRA's ratios to dense and LoRA from them."""
    medians = {mode: {piece: statistics.median(s[piece] for s in runs) for piece in runs[0]} for mode, runs in samples.items()}
    logra = medians["logra"]
    without_probe = logra["step"] - logra["kl_probe"]
    return {
        "samples": samples,
        "medians_s": medians,
        "logra_over_dense": logra["step"] / medians["dense"]["step"],
        "logra_over_dense_without_probe": without_probe / medians["dense"]["step"],
        "logra_over_lora": logra["step"] / medians["lora"]["step"],
        "logra_over_lora_without_probe": without_probe / medians["lora"]["step"],
        "probe_share_of_logra_step": logra["kl_probe"] / logra["step"],
        "paired_logra_over_dense": [l["step"] / d["step"] for l, d in zip(samples["logra"], samples["dense"])],
    }


def render(result: dict) -> str:
    lines = [
        "| tokens / micro-batch | mode | forward + backward s | update s | KL probe s | step s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for mode in MODES:
            m = row["medians_s"][mode]
            lines.append(f"| {row['tokens_per_micro_batch']} | {mode} | {m['forward_backward']:.1f} | {m['update']:.2f} | "
                         f"{m['kl_probe']:.1f} | {m['step']:.1f} |")
    lines += ["", "| tokens / micro-batch | LoGRA / dense | without probe | LoGRA / LoRA | without probe | probe share of LoGRA step |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['tokens_per_micro_batch']} | **{row['logra_over_dense']:.3f}** | {row['logra_over_dense_without_probe']:.3f} | "
                     f"{row['logra_over_lora']:.3f} | {row['logra_over_lora_without_probe']:.3f} | {100 * row['probe_share_of_logra_step']:.0f}% |")
    first = result["rows"][0]
    lines += [
        "",
        f"Target LoGRA / dense <= {TARGET} ({first['tokens_per_micro_batch']} tokens): "
        f"{'met' if first['logra_over_dense'] <= TARGET else 'missed'} with the probe, "
        f"{'met' if first['logra_over_dense_without_probe'] <= TARGET else 'missed'} without it.",
        "",
        f"{machine_line(result['machine'])}; median of {result['reps']} repetitions, {MICRO_BATCHES} micro-batches of one sequence, "
        f"probe on {PROBE_RESPONSES} sequences; command: `{result['command']}`.",
    ]
    for row in result["rows"]:
        if "added" in row:
            added = row["added"]
            lines.append(f"Row {row['tokens_per_micro_batch']} was measured in a separate run: {machine_line(added['machine'])}; "
                         f"median of {added['reps']} repetitions; command: `{added['command']}`." + (f" {added['note']}" if "note" in added else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
    for axis, row in zip(axes[0], rows):
        stacked_bars(axis, list(MODES), {piece.replace("_", " "): [row["medians_s"][mode][piece] for mode in MODES]
                                         for piece in ("forward_backward", "update", "kl_probe")})
        axis.set_ylabel("median seconds per step")
        axis.set_title(f"{row['tokens_per_micro_batch']} tokens x {MICRO_BATCHES} micro-batches: LoGRA / dense "
                       f"{row['logra_over_dense']:.2f} ({row['logra_over_dense_without_probe']:.2f} without probe)", fontsize=9)
        axis.legend(fontsize=8)
    figure.suptitle(f"Train step, 156M Qwen2 - CPU ({result['machine']['cpus']} cores), {result['machine']['date_utc'][:10]}, "
                    f"{result['command']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--render", type=Path, metavar="JSON", help="only redraw .md/.png from a results file")
    parser.add_argument("--add", action="store_true", help="append the measured rows to results/speed.json instead of replacing it")
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/speed.py", *sys.argv[1:]])
    if args.render:
        result = json.loads(args.render.read_text())
    elif args.add:
        result = json.loads((RESULTS / "speed.json").read_text())
        measured = {row["tokens_per_micro_batch"] for row in result["rows"]}
        if measured & set(args.tokens):
            parser.error(f"--add: results/speed.json already has rows for {sorted(measured & set(args.tokens))} tokens")
        for tokens in args.tokens:
            started = time.perf_counter()
            row = measure_tokens(tokens, args.reps)
            row["added"] = {"command": command, "machine": machine_info(),
                            "reps": args.reps, "runtime_s": time.perf_counter() - started}
            result["rows"].append(row)
            (RESULTS / "speed.json").write_text(json.dumps(result, indent=1))
    else:
        started = time.perf_counter()
        rows = [measure_tokens(tokens, args.reps) for tokens in args.tokens]
        result = {"command": command, "machine": machine_info(), "reps": args.reps,
                  "rows": rows, "runtime_s": time.perf_counter() - started}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "speed.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "speed.md").write_text(render(result) + "\n")
    plot(result, RESULTS / "speed.png")
    print(render(result))


if __name__ == "__main__":
    main()
