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

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .harness import (ROOT, argument_parser, build_mode, check_smoke_out, code_version, command_line, load_json,
                      machine_info, machine_line, micro_batching, pyplot, random_token_rows, replay_rollouts,
                      save_figure, save_json, status_kib, write_outputs)
from .loading import LOADING_MODEL
from .model_shapes import QWEN_SHAPES, SMOKE

GIB, MIB = 2**30, 2**20
METHODS = ("dense", "lora", "logra")
TOLERANCE = 0.15
SMOLLM2_135M = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
DEVICE_BYTES, MARGIN_BYTES = 80 * 10**9, 4 * GIB
TABLE_TOKENS = (4096, 16384)
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}

VALIDATION_CASES = [
    dict(case="quickstart", shape=SMOLLM2_135M, rows=32, generations=8, prompt=40, completion=16, micro_batch_size=16,
         checkpointing=False, logra_rank="auto", world=1),
    *(dict(case="loading-0.31B", shape=LOADING_MODEL, rows=2, generations=2, prompt=128, completion=896,
           micro_batch_size=1, checkpointing=True, logra_rank=256, world=world) for world in (1, 2)),
]



def build_model(shape: dict, *, meta: bool = False):
    """A random-init causal LM of ``shape`` (``arch``: qwen2 by default, or llama)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(shape)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[shape.pop("arch", "qwen2")]
    with torch.device("meta") if meta else torch.device("cpu"):
        return model_class(config_class(**shape))


def predict(case: dict, method: str):
    """``step_memory`` of ``case``'s step under ``method``, for a CPU process (float32)."""
    from lightning_logra import LoGRAConfig
    from lightning_logra.planning.step_memory import StepSettings, step_memory

    row_tokens = case["prompt"] + case["completion"]
    settings = StepSettings(method=method, tokens=case["micro_batch_size"] * row_tokens, row_tokens=row_tokens,
                            world_size=case["world"], masked=False, activation_checkpointing=case["checkpointing"],
                            cpu_optimizer=True, logra=LoGRAConfig(rank=case["logra_rank"], probe_responses=2,
                                                                  probe_max_tokens=row_tokens))
    return step_memory(build_model(case["shape"], meta=True), settings)


def measure_rank(case: dict, method: str) -> dict:
    """One rank's measurement (module docstring); run in a fresh process."""
    import torch
    import torch.distributed as dist

    world = case["world"]
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    started = time.perf_counter()
    if not case.get("generate"):
        # The same step once on a tiny model of the same architecture first: the lazy imports
        # (model classes, peft, the library's step) and the kernels' first-use workspaces
        # then sit below the baseline instead of in the step's measurement.
        tiny = {**case, "shape": {**case["shape"], **{k: v for k, v in SMOKE.items() if k != "tie_word_embeddings"}},
                "world": 1, "rows": 2, "generations": 2, "prompt": 4, "completion": 4, "micro_batch_size": 1,
                "logra_rank": 4}
        _steps(tiny, method, None)
        gc.collect()
    baseline = status_kib("VmRSS")
    shard = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_logra import LoGRAConfig
        from lightning_logra.strategies.sharding import shard_policy

        mesh = init_device_mesh("cpu", (world,))
        shard = lambda module: shard_policy(module, mesh, LoGRAConfig().target_modules)  # noqa: E731
    torch.manual_seed(0)
    model = build_model(case["shape"])
    runner, replay, generate_s = _prepare(model, case, method, rank, shard)
    if not case.get("generate"):  # the step's memory, not the random init's (the search counts everything)
        Path("/proc/self/clear_refs").write_text("5")
    step_s = [runner.step(replay)["step"] for _ in range(2)]
    result = {"rank": rank, "peak_mib": (status_kib("VmHWM") - baseline) / 1024,
              "peak_rss_mib": status_kib("VmHWM") / 1024, "imports_mib": baseline / 1024,
              "generate_s": generate_s, "step_s": step_s, "total_s": time.perf_counter() - started}
    if world > 1:
        dist.destroy_process_group()
    return result


def _prepare(model, case: dict, method: str, rank: int, shard):
    """The replayed rollouts of ``case`` (after a short generation when ``case['generate']``)
    and ``method``'s runner over ``model``."""
    import torch

    vocab = case["shape"]["vocab_size"]
    settings = micro_batching(case["completion"], micro_batch_size=case["micro_batch_size"])
    ids = random_token_rows(case["rows"], case["prompt"], case["completion"], vocab, num_generations=case["generations"],
                            seed=1 + rank)
    generate_s = 0.0
    if case.get("generate"):  # a short sampled generation from the prompts, as a step starts
        clock = time.perf_counter()
        with torch.no_grad():
            ids = model.generate(ids[:, :case["prompt"]], attention_mask=torch.ones_like(ids[:, :case["prompt"]]),
                                 do_sample=True, min_new_tokens=case["completion"], max_new_tokens=case["completion"],
                                 pad_token_id=0, eos_token_id=None)
        generate_s = time.perf_counter() - clock
    replay = replay_rollouts(model, ids, case["prompt"], num_generations=case["generations"], seed=1 + rank,
                             settings=settings)
    runner = build_mode(method, model, settings, probe_responses=2, probe_max_tokens=case["prompt"] + case["completion"],
                        shard=shard, activation_checkpointing=case["checkpointing"], rank=case["logra_rank"])
    return runner, replay, generate_s


def _steps(case: dict, method: str, shard) -> None:
    """Two steps of ``case`` on a fresh random model, nothing kept."""
    import torch

    torch.manual_seed(0)
    runner, replay, _ = _prepare(build_model(case["shape"]), case, method, 0, shard)
    for _ in range(2):
        runner.step(replay)


def launch(case: dict, method: str, *, budget_bytes: int | None = None) -> list[dict] | str:
    """``case`` under ``method`` in ``case['world']`` fresh processes: one result per rank,
    or why it did not complete (``"over budget"``, or the failure's last lines)."""
    import psutil

    port = 29500 + (os.getpid() % 2000)
    processes = []
    for rank in range(case["world"]):
        env = dict(os.environ, **ENVIRONMENT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(case["world"]), RANK=str(rank), LOCAL_RANK=str(rank))
        processes.append(subprocess.Popen([sys.executable, "-m", "benchmarks.fits", "--worker", json.dumps([case, method])],
                                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    over = False
    while any(process.poll() is None for process in processes):
        if budget_bytes is not None:
            for process in processes:
                try:
                    if process.poll() is None and psutil.Process(process.pid).memory_info().rss > budget_bytes:
                        process.kill()
                        over = True
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.1)
    outputs = [process.communicate() for process in processes]
    if over:
        return "over budget"
    results = []
    for process, (stdout, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            return f"exit {process.returncode}: {stderr.strip().splitlines()[-1] if stderr.strip() else 'no output'}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


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
        from .fits_search import render_search

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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        case, method = json.loads(args.worker)
        if method.startswith("trl_"):
            from .fits_search import measure_trl

            print(json.dumps(measure_trl(case, method)))
        else:
            print(json.dumps(measure_rank(case, method)))
        return
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

        from .fits_search import SEARCH_METHODS, search

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
