"""``fits --search``: the largest Qwen2.5-shaped model whose RL step completes in a memory
budget, per method, ours beside TRL's ``GRPOTrainer`` (the CPU analog of the paper's headline).

Qwen2.5-shaped random models (the Qwen2.5-3B decoder layer: hidden 2048, MLP 11008, 16
heads, 2 KV heads, 151,936-token tied vocabulary; the number of layers searched), each try
in a fresh process that builds the model, samples 2 prompts x 2 generations of 24 + 8
tokens and runs two RL steps on them (the second holds the optimizer state a long run
holds); the process is killed when its RSS passes the budget. Five methods, the same
prompts, lengths, micro-batch (all 4 rows), activation checkpointing and no KL reference:

- ``dense``, ``lora`` (r=256), ``logra`` (r=256): the library's own step on rollouts
  sampled from the model (``fits.measure_rank``);
- ``trl_full``: ``trl.GRPOTrainer`` training every parameter (its default AdamW);
- ``trl_lora``: ``trl.GRPOTrainer`` with a peft LoRA of r=256 (alpha 512) on the seven
  projections of every layer, as our ``lora``.

TRL's prompts are 24 tokens of the SmolLM2 tokenizer (ids below the model's vocabulary)
and its generations are held at exactly 8 tokens (``min_new_tokens``), so that every method
holds the same rows. TRL's step seconds include its generation; ours do not.

Every method's search resolves its limit to one layer: it starts at the deepest depth
completed by the previous search in the results file (else at ``step_memory``'s prediction;
TRL's at our dense or LoRA prediction), gallops by 1, 2, 4, ... layers until one depth
completes and another does not, then bisects between them.
"""

from __future__ import annotations

from .fits_runs import build_model, launch, predict
from .harness import machine_line
from .model_shapes import SMOKE

MIB = 2**20
QWEN25_3B_LAYER = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                       vocab_size=151936, tie_word_embeddings=True)
OURS = ("dense", "lora", "logra")
TRL_METHODS = ("trl_full", "trl_lora")
SEARCH_METHODS = OURS + TRL_METHODS
# The prediction a TRL search starts from: ours for the same kind of training.
PREDICTED_AS = {"trl_full": "dense", "trl_lora": "lora"}
LORA_RANK = 256
SMOLLM2_VOCABULARY = 49152
TARGET_RATIO = 3.0  # issue 43: LoGRA's model at least 3x TRL full-parameter's


def search_case(smoke: bool) -> dict:
    return dict(case="search", rows=4, generations=2, prompt=24, completion=8, micro_batch_size=4, checkpointing=True,
                logra_rank=LORA_RANK if not smoke else 16, world=1, generate=True)


def search(budget_bytes: int, *, previous: list[dict] | None = None, methods=SEARCH_METHODS,
           smoke: bool = False) -> list[dict]:
    """Per method, every depth tried and its outcome (module docstring)."""
    # The smoke run's tiny model gets the SmolLM2 tokenizer's vocabulary, which TRL's prompts use.
    base = dict(SMOKE, vocab_size=SMOLLM2_VOCABULARY) if smoke else dict(QWEN25_3B_LAYER)
    case = search_case(smoke)
    rows = []
    for method in methods:
        def attempt(depth: int) -> bool:
            outcome = launch({**case, "shape": {**base, "num_hidden_layers": depth}}, method, budget_bytes=budget_bytes)
            tried[depth] = outcome
            print(f"search {method} {depth} layers: {outcome if isinstance(outcome, str) else 'completed'}", flush=True)
            return not isinstance(outcome, str)

        tried: dict[int, object] = {}
        if smoke:
            attempt(2)
        else:
            _bracket_and_bisect(attempt, _start_depth(method, base, case, budget_bytes, previous or []))
        for depth, outcome in sorted(tried.items()):
            model = build_model({**base, "num_hidden_layers": depth}, meta=True)
            rows.append({"method": method, "layers": depth, "parameters": sum(p.numel() for p in model.parameters()),
                         "completed": not isinstance(outcome, str),
                         "outcome": outcome if isinstance(outcome, str) else outcome[0]})
    return rows


def _bracket_and_bisect(attempt, start: int) -> None:
    """Find, to one layer, the deepest depth for which ``attempt`` succeeds."""
    deepest_completed, shallowest_failed = 0, None
    depth, step = start, 1
    while True:
        if attempt(depth):
            deepest_completed = depth
        else:
            shallowest_failed = depth
        if shallowest_failed is not None and (deepest_completed or depth == 1):
            break
        depth = depth + step if shallowest_failed is None else max(1, depth - step)
        step *= 2
    while deepest_completed and shallowest_failed - deepest_completed > 1:
        middle = (deepest_completed + shallowest_failed) // 2
        if attempt(middle):
            deepest_completed = middle
        else:
            shallowest_failed = middle


def _start_depth(method: str, base: dict, case: dict, budget_bytes: int, previous: list[dict]) -> int:
    completed = [row["layers"] for row in previous if row["method"] == method and row["completed"]]
    if completed:
        return max(completed)
    predicted_as = PREDICTED_AS.get(method, method)
    imports = 600 * MIB  # torch + transformers + peft in the process before the model (measured: about 0.6 GiB)
    depth = 1
    while depth <= 400:
        shaped = {**case, "shape": {**base, "num_hidden_layers": depth + 1}}
        if predict(shaped, predicted_as).peak + imports > budget_bytes:
            break
        depth += 1
    return depth


def render_search(result: dict) -> list[str]:
    lines = ["## The CPU analog: the largest Qwen2.5-shaped model whose RL step completes here", "",
             f"Budget {result['search_budget_gib']:.1f} GiB of RSS per process ({machine_line(result['search_machine'])}, "
             f"{result['search_machine'].get('memory_gib', '?')} GiB memory). Each try: build, generate 2 x 2 x 8 "
             "tokens, two RL steps (TRL's step seconds include its generation).", "",
             "| method | layers | parameters | completed | peak RSS GiB | steps s |", "|---|---:|---:|---|---:|---:|"]
    for row in result["search"]:
        outcome = row["outcome"]
        peak = f"{outcome['peak_rss_mib'] / 1024:,.1f}" if row["completed"] else outcome
        steps = " / ".join(f"{s:.0f}" for s in outcome["step_s"]) if row["completed"] else "-"
        lines.append(f"| {row['method']} | {row['layers']} | {row['parameters'] / 1e9:.2f}B | "
                     f"{'yes' if row['completed'] else 'no'} | {peak} | {steps} |")
    methods = list(dict.fromkeys(row["method"] for row in result["search"]))
    best = {method: largest_completed(result["search"], method) for method in methods}
    lines += ["", "Largest completed: " + "; ".join(
        f"{method} {row['parameters'] / 1e9:.2f}B" if row else f"{method} none" for method, row in best.items()) + "."]
    if best.get("logra") and best.get("trl_full"):
        ratio = best["logra"]["parameters"] / best["trl_full"]["parameters"]
        lines.append(f"LoGRA's model is {ratio:.2f}x TRL full-parameter's (target >= {TARGET_RATIO:.0f}x: "
                     f"{'met' if ratio >= TARGET_RATIO else 'missed'}).")
    if "search_command" in result:
        lines.append(f"Command: `{result['search_command']}`; commit {result.get('search_commit', '?')}.")
    return lines


def largest_completed(rows: list[dict], method: str) -> dict | None:
    return max((row for row in rows if row["method"] == method and row["completed"]),
               key=lambda row: row["parameters"], default=None)
