"""What fits: one RL step's memory per rank, predicted by ``step_memory`` and measured.

Three parts, each added to ``benchmarks/results/fits.json`` (``.md``, ``.png``):

``--validate``: the prediction against measurements. Each case runs in fresh processes
(``MALLOC_MMAP_THRESHOLD_=65536``, so that peak RSS tracks live tensors, as in
``memory.py``): a random-init model, a fixed rollout batch replayed through the library's
own step (``harness.Runner.step``) twice, so the second step holds the optimizer state a
long run holds. Measured = the rank's peak RSS over the two steps (``VmHWM``, reset once
the model is built and sharded) minus its RSS before the model was built. Cases:
  - ``quickstart``: the quickstart's step on SmolLM2-135M's shape (Llama, random weights):
    4 prompts x 8 generations of 40 + 16 tokens, 16 rows per micro-batch, no activation
    checkpointing, LoGRA at rank ``auto`` (64), LoRA r=256; one process.
  - ``loading-0.31B``: ``loading.py``'s 0.31B Qwen2 (the per-rank loading model), 2 rows of
    1,024 tokens one per micro-batch, activation checkpointing, rank 256; 1 and 2 processes
    (gloo, FSDP2 over both, as ``logra_fsdp`` shards).
  Target: every prediction within 15% of its measurement.

``--table``: predictions only, for Qwen2.5-1.5B / 7B / 14B and the 27B-class shape on
8 x 80 GB (bf16 autocast over float32 master weights, as ``logra_fsdp`` runs; activation
checkpointing; one packed row of 4k or 16k tokens per micro-batch; no KL reference; no
vLLM share), dense AdamW vs LoRA r=256 vs LoGRA r=256, marking what fits in 80 GB with a
4 GiB margin (CUDA context, NCCL buffers, allocator slack).

``--search`` (``fits_search``): the CPU analog of the paper's headline, the largest
Qwen2.5-shaped model whose RL step completes in ``--budget-gib`` of RSS per process (default:
this machine's memory less 1.5 GiB for the system), for our dense AdamW, LoRA and LoGRA and
for TRL's ``GRPOTrainer`` full-parameter and with LoRA. Run it alone: nothing else may hold
memory meanwhile.

    python -m benchmarks.fits --validate    # about 30 minutes on 2 cores
    python -m benchmarks.fits --table       # seconds (meta device)
    python -m benchmarks.fits --search      # about an hour, alone on the machine
    python -m benchmarks.fits --smoke --out /tmp/fits   # every code path on tiny models (or the parts named)
    python -m benchmarks.fits --render benchmarks/results/fits.json
"""

from __future__ import annotations

from pathlib import Path

from .fits_runs import build_model, launch, predict
from .fits_search import SEARCH_METHODS, render_search, search
from .harness import (argument_parser, check_smoke_out, code_version, command_line, load_json, machine_info,
                      machine_line, pyplot, save_figure, save_json, write_outputs)
from .loading import LOADING_MODEL
from .model_shapes import QWEN_SHAPES, SMOKE

GIB, MIB = 2**30, 2**20
METHODS = ("dense", "lora", "logra")
TOLERANCE = 0.15
SMOLLM2_135M = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
DEVICE_BYTES, MARGIN_BYTES = 80 * 10**9, 4 * GIB
TABLE_TOKENS = (4096, 16384)

VALIDATION_CASES = [
    dict(case="quickstart", shape=SMOLLM2_135M, rows=32, generations=8, prompt=40, completion=16, micro_batch_size=16,
         checkpointing=False, logra_rank="auto", world=1),
    *(dict(case="loading-0.31B", shape=LOADING_MODEL, rows=2, generations=2, prompt=128, completion=896,
           micro_batch_size=1, checkpointing=True, logra_rank=256, world=world) for world in (1, 2)),
]



def predicted_row(row: dict, case: dict) -> dict:
    """``row`` (a measurement of ``case`` under ``row['method']``) with ``step_memory``'s prediction."""
    predicted = predict(case, row["method"])
    return {**row, "predicted_mib": predicted.peak / MIB, "error": predicted.peak / MIB / row["measured_mib"] - 1,
            "prediction": predicted.as_dict()}


def validate(cases: list[dict]) -> list[dict]:
    rows = []
    for case in cases:
        for method in METHODS:
            ranks = launch(case, method)
            if isinstance(ranks, str):
                raise SystemExit(f"{case['case']} {method} world {case['world']}: {ranks}")
            measured = max(rank["peak_mib"] for rank in ranks)
            rows.append(predicted_row({"case": case["case"], "world": case["world"], "method": method,
                                       "measured_mib": measured, "ranks": ranks}, case))
            print(f"{case['case']} world {case['world']} {method}: measured {measured:,.0f} MiB, predicted "
                  f"{rows[-1]['predicted_mib']:,.0f} ({rows[-1]['error']:+.1%})", flush=True)
    return rows


def table(shapes: dict[str, dict]) -> list[dict]:
    import torch

    from lightning_logra import LoGRAConfig
    from lightning_logra.planning.step_memory import StepSettings, step_memory

    rows = []
    for name, shape in shapes.items():
        model = build_model(shape, meta=True)
        parameters = sum(p.numel() for p in model.parameters())
        for tokens in TABLE_TOKENS:
            for method in METHODS:
                memory = step_memory(model, StepSettings(method=method, tokens=tokens, world_size=8, masked=True,
                                                         compute_dtype=torch.bfloat16, logra=LoGRAConfig(rank=256)))
                rows.append({"model": name, "parameters": parameters, "tokens": tokens, "method": method,
                             "fits": memory.fits(DEVICE_BYTES, MARGIN_BYTES), **memory.as_dict()})
    return rows


# --- rendering -----------------------------------------------------------------------------------

def render(result: dict) -> str:
    lines = ["# What fits: one RL step's memory per rank, predicted and measured", ""]
    if "validation" in result:
        rows = result["validation"]
        worst = max(abs(row["error"]) for row in rows)
        lines += ["## The prediction against measurements (CPU, float32)", "",
                  "| case | processes | method | measured MiB (largest rank) | predicted MiB | error |",
                  "|---|---:|---|---:|---:|---:|"]
        lines += [f"| {row['case']} | {row['world']} | {row['method']} | {row['measured_mib']:,.0f} | "
                  f"{row['predicted_mib']:,.0f} | {row['error']:+.1%} |" for row in rows]
        lines += ["", f"Largest error {worst:.1%} (target: every row within {TOLERANCE:.0%}: "
                      f"{'met' if worst <= TOLERANCE else 'missed'}).",
                  f"{machine_line(result['validation_machine'])}; command: `{result['validation_command']}`.", ""]
    if "table" in result:
        lines += ["## Predicted per-GPU peak on 8 x 80 GB (bf16 autocast, activation checkpointing, one packed row)", "",
                  f"GiB per GPU; **fits** = peak + {MARGIN_BYTES / GIB:.0f} GiB margin <= 80 GB. No KL reference, no vLLM "
                  "share. A prediction: none of these rows ran on a GPU.", "",
                  "| model | parameters | tokens / micro-batch | dense AdamW | LoRA r=256 | LoGRA r=256 |",
                  "|---|---:|---:|---:|---:|---:|"]
        cells = {(row["model"], row["tokens"], row["method"]): row for row in result["table"]}
        for (model, tokens) in dict.fromkeys((row["model"], row["tokens"]) for row in result["table"]):
            first = cells[(model, tokens, METHODS[0])]
            values = [cells[(model, tokens, method)] for method in METHODS]
            lines.append(f"| {model} | {first['parameters'] / 1e9:.1f}B | {tokens:,} | " + " | ".join(
                f"{row['peak'] / GIB:,.1f} {'**fits**' if row['fits'] else 'does not fit'}" for row in values) + " |")
        lines.append("")
    if "search" in result:
        lines += render_search(result)
    if result.get("smoke"):
        lines.append("**Smoke run on tiny models: no figure here is a measurement.**")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    if "validation" not in result:
        return
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.5))
    rows = result["validation"]
    labels = [f"{row['case']}\n{row['world']}p {row['method']}" for row in rows]
    positions = range(len(rows))
    axis.bar([p - 0.2 for p in positions], [row["measured_mib"] for row in rows], width=0.4, label="measured")
    axis.bar([p + 0.2 for p in positions], [row["predicted_mib"] for row in rows], width=0.4, label="predicted")
    axis.set_xticks(list(positions), labels, fontsize=6)
    axis.set_ylabel("MiB per rank")
    save_figure(figure, path, "step_memory: predicted vs measured peak per rank (CPU)")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--validate", action="store_true", help="measure the validation cases")
    parser.add_argument("--table", action="store_true", help="predict the 8 x 80 GB table")
    parser.add_argument("--search", action="store_true", help="search the largest model per method (alone!)")
    parser.add_argument("--methods", nargs="+", help="search only these methods (default: all five), keeping "
                        "the others' rows")
    parser.add_argument("--budget-gib", type=float, help="the search's RSS budget (default: memory less 1.5 GiB)")
    parser.add_argument("--predict-again", action="store_true",
                        help="measure nothing: recompute the validation rows' predictions with the current step_memory")
    parser.add_argument("--smoke", action="store_true", help="every part on tiny models, measuring nothing")
    args = parser.parse_args()
    check_smoke_out(parser, args)
    stem = args.out / "fits"
    if args.render:
        write_outputs(stem, load_json(args.render), render, plot)
        return
    result = load_json(stem.with_suffix(".json")) if stem.with_suffix(".json").exists() and not args.smoke else {}
    result.update(code=code_version(), smoke=args.smoke)
    if args.predict_again:
        result["validation"] = [predicted_row(row, next(case for case in VALIDATION_CASES if
                                                          (case["case"], case["world"]) == (row["case"], row["world"])))
                                for row in result["validation"]]
    if args.smoke and not (args.validate or args.table or args.search):
        args.validate = args.table = args.search = True
    if args.validate:
        # The smoke run: one process and two, each on the tiny model.
        cases = VALIDATION_CASES if not args.smoke else [
            {**case, "shape": dict(SMOKE, num_hidden_layers=2), "prompt": 8, "completion": 8,
             "logra_rank": 16} for case in VALIDATION_CASES[1:]]
        result.update(validation=validate(cases), validation_machine=machine_info(),
                      validation_command=command_line("fits"))
    if args.table:
        result["table"] = table(QWEN_SHAPES if not args.smoke else {"smoke": SMOKE})
    if args.search:
        import psutil

        total = psutil.virtual_memory().total
        budget = int((args.budget_gib * GIB) if args.budget_gib else total - 1.5 * GIB)
        budget = min(budget, 4 * GIB) if args.smoke else budget
        methods = args.methods or SEARCH_METHODS
        rows = search(budget, previous=result.get("search", []), methods=methods, smoke=args.smoke)
        kept = [row for row in result.get("search", []) if row["method"] not in methods] if args.methods else []
        result.update(search=kept + rows, search_budget_gib=budget / GIB, search_machine=machine_info(),
                      search_command=command_line("fits"), search_commit=code_version()["git_commit"])
    save_json(stem.with_suffix(".json"), result)
    write_outputs(stem, result, render, plot)


if __name__ == "__main__":
    main()
