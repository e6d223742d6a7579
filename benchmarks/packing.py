"""Padded vs packed micro-batches: one LoGRA step on rollouts of very different lengths.

A synthetic rollout batch (random tokens; each prompt's ``num_generations`` responses spread
evenly from ``--min-response`` to ``--max-response`` tokens, shuffled) is trained twice side
by side, from the same weights, through the library's own step (``harness``): padded
micro-batches of ``--micro-batch-size`` left-padded rows (GRPOModule's default), and packed
micro-batches of at most ``--micro-batch-tokens`` real tokens, each one row whose position
ids restart per sequence (``batching.micro_batch_tokens``). Each step is
``rl.batch.backward_micro_batches`` (the default GRPO loss, activation checkpointing), then
``LoGRAOptimizer.step`` with the KL probe on 2 rows (packed too in the packed mode).

Also recorded: the token positions every forward/backward computed (one untimed pass per
mode, counted at the input embeddings) against the batch's real tokens.

Target: packed step <= 0.75 x padded step; packed tokens computed = real tokens.

    python -m benchmarks.packing                              # SmolLM2-135M, 16 rows of 8-256 response tokens
    python -m benchmarks.packing --smoke --out /tmp/packing   # every code path on a tiny model, seconds
    python -m benchmarks.packing --render benchmarks/results/packing.json
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from .harness import (alternate_modes, argument_parser, build_mode, check_smoke_out, code_version, command_line,
                      cpu_caption, load_json, machine_info, machine_line, micro_batching, pyplot, save_figure,
                      save_json, stacked_bars, summarise, write_outputs)
from .harness.step import Replay
from .model_shapes import SMOKE

MODEL = "smollm2-135m-instruct"  # the library's built-in model (lightning_logra.models.load_policy)
TARGET = 0.75  # packed step / padded step
MODES = ("padded", "packed")
PIECES = ("forward_backward", "kl_probe", "update")


def response_lengths(rows: int, shortest: int, longest: int, seed: int) -> list[int]:
    """``rows`` lengths evenly from ``shortest`` to ``longest``, in a seeded random order."""
    import torch

    even = [round(shortest + (longest - shortest) * i / max(rows - 1, 1)) for i in range(rows)]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return [even[i] for i in order]


def synthetic_rollouts(model, *, rows: int, generations: int, prompt_tokens: int, lengths: list[int], seed: int,
                       settings) -> Replay:
    """Random prompts (shared by each group of ``generations`` rows) and responses of
    ``lengths``, ended on EOS, with the initial weights' log-probs as the rollout log-probs and
    GRPO advantages of random rewards, as a ``RolloutBatch``."""
    import torch

    from lightning_logra.rl.batch import RolloutBatch, batch_logprobs
    from lightning_logra.rl.advantages import group_advantages
    from lightning_logra.rollout.base import pack_rollouts

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(rows // generations)]
    responses = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
    rollouts = pack_rollouts([prompts[row // generations] for row in range(rows)], responses,
                             [[0.0] * n for n in lengths], [""] * rows, [True] * rows, pad_token_id=0)
    with torch.no_grad():
        scored = batch_logprobs(model, rollouts.input_ids, rollouts.attention_mask, settings)
    mask = rollouts.completion_mask[:, 1:].bool()
    rollout_logprobs = torch.where(mask, scored, 0.0)
    advantages = group_advantages(torch.randn(rows, generator=generator), generations)
    return Replay(RolloutBatch(rollouts, mask, rollout_logprobs, advantages), generations)


def tokens_computed(runner, replay: Replay) -> int:
    """Token positions one untimed forward/backward of the runner's settings computes
    (counted at the input embeddings, which activation checkpointing never recomputes); its
    sketches are then zeroed, so the timed steps start as before."""
    import torch

    from lightning_logra.rl.batch import backward_micro_batches
    from lightning_logra.rl.metrics import PassTotals

    counts = []
    handle = runner.model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: counts.append(args[0].numel()))
    try:
        backward_micro_batches(runner.model, replay.batch, slice(0, replay.rows), runner.settings,
                               backward=torch.Tensor.backward, passes=PassTotals.zeros(replay.batch.mask.device))
    finally:
        handle.remove()
    runner.optimizer.zero_grad()
    return sum(counts)


def measure(args, model, shape_name: str) -> dict:
    import copy

    lengths = response_lengths(args.rows, args.min_response, args.max_response, seed=1)
    probe_tokens = args.prompt_tokens + args.max_response
    padded_settings = micro_batching(args.max_response, micro_batch_size=args.micro_batch_size)
    real_per_row = args.prompt_tokens + statistics.mean(lengths)
    budget = args.micro_batch_tokens or math.ceil(args.micro_batch_size * real_per_row)
    packed_settings = micro_batching(args.max_response, micro_batch_size=args.micro_batch_size, micro_batch_tokens=budget)
    replay = synthetic_rollouts(model, rows=args.rows, generations=args.generations, prompt_tokens=args.prompt_tokens,
                                lengths=lengths, seed=1, settings=packed_settings)
    runners = {}
    for mode, settings in (("padded", padded_settings), ("packed", packed_settings)):
        runners[mode] = build_mode("logra", copy.deepcopy(model), settings, probe_responses=2,
                                   probe_max_tokens=probe_tokens)
    attention_mask = replay.batch.rollouts.attention_mask
    tokens = {"real": int(attention_mask.sum()), "padded_batch": int(attention_mask.numel())}
    micro_batches = {}
    for mode, runner in runners.items():
        tokens[mode] = tokens_computed(runner, replay)
        micro_batches[mode] = len(runner.settings.micro_batches(attention_mask, slice(0, replay.rows)))
    run = alternate_modes(runners, replay, args.reps, label="packing")
    summary = summarise(run["samples"], run["contention"])
    medians = summary["medians_s"]
    paired = [k["step"] / p["step"] for k, p in zip(run["samples"]["packed"], run["samples"]["padded"])]
    return {
        "model": shape_name, "rows": args.rows, "num_generations": args.generations, "prompt_tokens": args.prompt_tokens,
        "response_lengths": lengths, "micro_batch_size": args.micro_batch_size, "micro_batch_tokens": budget,
        "micro_batches": micro_batches, "tokens_computed": tokens, **summary,
        "packed_over_padded": medians["packed"]["step"] / medians["padded"]["step"],
        "paired_packed_over_padded": paired,
        "target_met": medians["packed"]["step"] / medians["padded"]["step"] <= TARGET,
        "tokens_equal_real": tokens["packed"] == tokens["real"],
    }


def render(result: dict) -> str:
    lines = []
    if result.get("smoke"):
        lines += ["**Smoke run on a tiny model: no figure here is a measurement.**", ""]
    tokens, medians = result["tokens_computed"], result["medians_s"]
    lines += ["| mode | micro-batches | token positions computed | forward + backward (s) | KL probe (s) | "
              "rest of the LoGRA update (s) | step (s) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        m = medians[mode]
        lines.append(f"| {mode} | {result['micro_batches'][mode]} | {tokens[mode]:,} | {m['forward_backward']:.2f} | "
                     f"{m['kl_probe']:.2f} | {m['update']:.2f} | {m['step']:.2f} |")
    lengths = result["response_lengths"]
    lines += [
        "",
        f"Packed / padded step (medians): **{result['packed_over_padded']:.3f}** (target <= {TARGET}: "
        f"{'met' if result['target_met'] else 'missed'}); paired per repetition "
        f"{', '.join(f'{r:.3f}' for r in result['paired_packed_over_padded'])}. Real tokens {tokens['real']:,} "
        f"(the padded batch {tokens['padded_batch']:,}); packed computes "
        f"{'exactly the real tokens' if result['tokens_equal_real'] else format(tokens['packed'], ',')}.",
        "",
        f"Step: {result['model']}, {result['rows']} rows ({result['rows'] // result['num_generations']} prompts x "
        f"{result['num_generations']} generations) of {result['prompt_tokens']} prompt tokens + responses of "
        f"{min(lengths)} to {max(lengths)} tokens; padded micro-batches of {result['micro_batch_size']} rows vs packed "
        f"of <= {result['micro_batch_tokens']} real tokens; `backward_micro_batches` (loss `grpo`, activation "
        f"checkpointing), then `LoGRAOptimizer.step` (rank 256, probe on 2 rows).",
        "",
        f"{machine_line(result['machine'])}; {len(result['samples']['packed'])} repetitions; command: `{result['command']}`.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    figure, (times, tokens) = plt.subplots(1, 2, figsize=(10, 4))
    medians = result["medians_s"]
    stacked_bars(times, list(MODES), {piece: [medians[mode][piece] for mode in MODES] for piece in PIECES})
    times.set(ylabel="seconds (median step)")
    computed = result["tokens_computed"]
    tokens.bar(list(MODES), [computed[mode] for mode in MODES], color="tab:gray")
    tokens.axhline(computed["real"], color="black", linewidth=1, label="real tokens")
    tokens.set(ylabel="token positions per forward/backward")
    save_figure(figure, path, f"Padded vs packed micro-batches, {result['model']} - {cpu_caption(result['machine'])}\n"
                              f"{result['command']}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=None, help="rollouts per step (default 16; smoke: 4)")
    parser.add_argument("--generations", type=int, default=None, help="responses per prompt (default 8; smoke: 2)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 32; smoke: 4)")
    parser.add_argument("--min-response", type=int, default=None, help="shortest response (default 8; smoke: 2)")
    parser.add_argument("--max-response", type=int, default=None, help="longest response (default 256; smoke: 16)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rows per padded micro-batch (default 4; smoke: 2)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="real tokens per packed micro-batch (default: --micro-batch-size x the mean real row)")
    parser.add_argument("--reps", type=int, default=None, help="measured repetitions (default 5; smoke: 1)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model (model_shapes.SMOKE): measures nothing")
    args = parser.parse_args()
    check_smoke_out(parser, args)
    stem = args.out / "packing"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    defaults = ((4, 2, 4, 2, 16, 2, 1) if args.smoke else (16, 8, 32, 8, 256, 4, 5))
    names = ("rows", "generations", "prompt_tokens", "min_response", "max_response", "micro_batch_size", "reps")
    for name, default in zip(names, defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    import torch

    if args.smoke:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.set_num_threads(1)  # a tiny model's many small ops run fastest on one thread
        torch.manual_seed(0)
        model, name = Qwen2ForCausalLM(Qwen2Config(**SMOKE)), "a tiny random Qwen2 (model_shapes.SMOKE)"
    else:
        from lightning_logra.models import load_policy

        model, _ = load_policy(MODEL)
        name = "SmolLM2-135M-Instruct"
    started = time.perf_counter()
    result = measure(args, model, name)
    result.update({"command": command_line("packing"), "machine": machine_info(), "code": code_version(),
                   "smoke": args.smoke, "runtime_s": time.perf_counter() - started})
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
