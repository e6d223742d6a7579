"""One try of the "what fits" benchmark (``fits``, ``fits_search``): a case's RL step under
one method, measured in fresh processes (``launch``), each running this module.

Ours (``dense``, ``lora``, ``logra``: ``measure_rank``) replays the library's own step;
TRL's (``trl_full``, ``trl_lora``: ``measure_trl``) runs ``trl.GRPOTrainer``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_logra.core.config import DEFAULT_TARGET_MODULES

from .harness import ROOT, build_mode, micro_batching, random_token_rows, replay_rollouts, status_kib
from .model_shapes import SMOKE

ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}


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
    """One rank's measurement, run in a fresh process: its peak RSS over two steps above its
    RSS before the model was built (``fits``' docstring), and the whole process's peak."""
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
        processes.append(subprocess.Popen([sys.executable, "-m", "benchmarks.fits_runs", json.dumps([case, method])],
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


def measure_trl(case: dict, method: str) -> dict:
    """One TRL try (``trl_full`` or ``trl_lora``), run in a fresh process: build, then two
    ``GRPOTrainer`` steps (each generating its own rows)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_logra.models import load_tokenizer, model_source

    started = time.perf_counter()
    tokenizer = load_tokenizer(model_source("smollm2-135m-instruct"))
    words = (" apple", " one", " red", " seven")
    prompts = [word * case["prompt"] for word in words]
    if any(len(tokenizer(prompt).input_ids) != case["prompt"] for prompt in prompts):
        raise SystemExit(f"a TRL prompt is not {case['prompt']} tokens")
    if len(tokenizer) > case["shape"]["vocab_size"]:
        raise SystemExit(f"the tokenizer's {len(tokenizer)} ids do not fit the model's vocabulary of "
                         f"{case['shape']['vocab_size']}")
    baseline = status_kib("VmRSS")
    torch.manual_seed(0)
    model = build_model(case["shape"])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    stamps: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    rank = case["logra_rank"]  # our LoRA's rank in the same case (256; 16 on the smoke run's tiny model)
    peft_config = (LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(DEFAULT_TARGET_MODULES), task_type="CAUSAL_LM")
                   if method == "trl_lora" else None)
    with tempfile.TemporaryDirectory() as output:
        config = GRPOConfig(
            output_dir=output, use_cpu=True, bf16=False, seed=0, max_steps=2, learning_rate=1e-6,
            per_device_train_batch_size=case["rows"], gradient_accumulation_steps=1,
            num_generations=case["generations"], max_completion_length=case["completion"],
            generation_kwargs={"min_new_tokens": case["completion"]}, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            gradient_checkpointing=case["checkpointing"], logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False)
        trainer = GRPOTrainer(model=model, args=config, reward_funcs=[varied_reward],
                              train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]),
                              processing_class=tokenizer, peft_config=peft_config, callbacks=[StepClock()])
        trainer.train()
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history
               if "completions/mean_length" in entry]
    return {"completion_lengths": lengths, "rank": 0, "peak_rss_mib": status_kib("VmHWM") / 1024, "imports_mib": baseline / 1024,
            "generate_s": None, "step_s": [end - begin for begin, end in zip(stamps[::2], stamps[1::2])],
            "total_s": time.perf_counter() - started}


def varied_reward(completions: list[str], **kwargs) -> list[float]:
    """A reward that differs between a prompt's generations (so that advantages, and the
    backward through them, are not zero) without reading anything but the text."""
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


if __name__ == "__main__":
    case, method = json.loads(sys.argv[1])
    print(json.dumps((measure_trl if method.startswith("trl_") else measure_rank)(case, method)))
