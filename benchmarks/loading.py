"""Per-rank host memory and time to set up GRPOModule under logra_fsdp on 2 gloo processes.

A random-init Qwen2-architecture model (``LOADING_MODEL``, 0.31B parameters) is written once
as hub-style sharded safetensors. Each run starts 2 fresh processes (no KL reference model;
one in float32 under ``32-true``; one in bfloat16 under ``bf16-mixed``); each rank builds ``GRPOModule`` and runs ``Trainer.fit`` under
``strategy="logra_fsdp"`` up to the first training batch. Reported per rank: the peak RSS
of setup above the RSS after imports (``VmHWM``, reset after imports), as a multiple of the
whole float32 model and above the shards the rank keeps, and the seconds from the start of
``fit`` to the first step.
Target: the setup peak <= 0.6 x the float32 model (a whole load per rank is >= 1.0 x,
>= 2.0 x with a reference).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness.records import (
    argument_parser,
    check_smoke_out,
    code_version,
    command_line,
    load_json,
    machine_info,
    save_json,
    status_kib,
    stacked_bars,
    write_outputs,
)
from .model_shapes import BENCH_156M, SMOKE

MIB = 2**20
LOADING_MODEL = {**BENCH_156M, "num_hidden_layers": 22}  # 0.31B parameters
TARGET = 0.6
# (kl_coef, precision): no reference; a float32 reference; a bfloat16 one (kept in the compute dtype)
RUNS = ((0.0, "32-true"), (0.1, "32-true"), (0.1, "bf16-mixed"))



def write_model(folder: Path, shape: dict) -> int:
    """The random model and a byte-level tokenizer in ``folder``; its float32 bytes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(folder, max_shard_size="200MB")  # several files and an index, as the hub's
    write_tokenizer(folder)
    return sum(p.numel() for p in model.parameters()) * 4


def write_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (256 symbols, EOS and pad) saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(folder)


def _local_bytes(model) -> int:
    """The bytes of ``model``'s parameters this rank stores (its shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def rank_main(folder: str, kl_coef: float, precision: str) -> dict:
    """One rank: imports, then GRPOModule + fit up to the first training batch."""
    import warnings

    import lightning as L

    from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
    from lightning_logra.data import PromptDataModule
    from lightning_logra.modules import GRPOModule, LossConfig, RewardConfig, RolloutConfig

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: setup only
    base_kib, started = status_kib("VmRSS"), time.perf_counter()
    measured = {}

    class FirstStep(Exception):
        """Ends the fit at its first batch: setup is what is measured."""

    class AtFirstStep(L.Callback):
        def on_train_batch_start(self, *args) -> None:
            models = [module.policy] + ([module.reference] if module.reference is not None else [])
            measured.update(seconds=time.perf_counter() - started, peak_kib=status_kib("VmHWM") - base_kib,
                            kept_bytes=sum(_local_bytes(model) for model in models))
            raise FirstStep

    module = GRPOModule(folder, loss=LossConfig(kl_coef=kl_coef), rollout=RolloutConfig(num_generations=2, max_new_tokens=4),
                        reward=RewardConfig(functions=["lightning_logra.rewards.math:math_reward"]))
    data = PromptDataModule(train="arithmetic", tokenizer=folder, batch_size=1, train_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            L.Trainer(accelerator="cpu", devices=2, strategy=LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8)), max_steps=1,
                      precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[AtFirstStep()]).fit(module, data)
        except FirstStep:
            pass
    return {"setup_peak_mib": measured["peak_kib"] / 1024, "kept_shards_mib": measured["kept_bytes"] / MIB,
            "seconds_to_first_step": measured["seconds"]}


def measure(folder: Path, kl_coef: float, precision: str) -> list[dict]:
    """Two fresh ranks, started as torchrun starts them; each one's row."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outputs = [Path(tempfile.mkstemp(suffix=".json")[1]) for _ in range(2)]
    processes = []
    for rank in range(2):
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "TORCHELASTIC_RUN_ID": "loading", "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen([sys.executable, "-m", "benchmarks.loading", "--rank-worker", str(folder),
                                           str(kl_coef), precision, str(outputs[rank])], env=environment))
    if any(process.wait() for process in processes):
        raise RuntimeError("a rank failed; its output is above")
    return [json.loads(path.read_text()) for path in outputs]


def render(result: dict) -> str:
    model_mib = result["model_float32_bytes"] / MIB
    lines = [("Smoke run on a tiny model: measures nothing.\n\n" if result["smoke"] else "")
             + f"GRPOModule under logra_fsdp on 2 gloo processes; model {result['parameters'] / 1e9:.2f}B parameters, "
             f"{model_mib:,.0f} MiB in float32, sharded safetensors. Target: setup peak <= {TARGET} x the model.",
             "The rank keeps its shards of the policy (float32) and of the reference (in the compute dtype): "
             "the peak above them is what loading costs.",
             "", "| reference model | precision | rank | setup peak above imports (MiB) | x float32 model "
             "| shards kept (MiB) | peak above shards kept (x model) | seconds to first step |",
             "|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for rank, row in enumerate(run["ranks"]):
            peak, kept = row["setup_peak_mib"], row["kept_shards_mib"]
            lines.append(f"| {'yes' if run['kl_coef'] > 0 else 'no'} | {run['precision']} | {rank} | {peak:,.0f} | "
                         f"{peak / model_mib:.2f} | {kept:,.0f} | {(peak - kept) / model_mib:.2f} | "
                         f"{row['seconds_to_first_step']:.1f} |")
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_mib = result["model_float32_bytes"] / MIB
    labels, kept, loading = [], [], []
    for run in result["runs"]:
        reference = {"32-true": "f32 ref", "bf16-mixed": "bf16 ref"}[run["precision"]] if run["kl_coef"] > 0 else "no ref"
        for rank, row in enumerate(run["ranks"]):
            labels.append(f"{reference}\nrank {rank}")
            kept.append(row["kept_shards_mib"] / model_mib)
            loading.append((row["setup_peak_mib"] - row["kept_shards_mib"]) / model_mib)
    figure, axis = plt.subplots(figsize=(7, 3.5))
    stacked_bars(axis, labels, {"shards the rank keeps": kept, "loading above them": loading})
    axis.axhline(TARGET, color="red", linestyle="--", label=f"target {TARGET} x")
    axis.axhline(1.0, color="grey", linestyle=":", label="one whole float32 model")
    axis.set_ylabel("setup peak / float32 model")
    axis.legend(fontsize="small", loc="upper left")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    if sys.argv[1:2] == ["--rank-worker"]:
        folder, kl_coef, precision, output = sys.argv[2], float(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
        output.write_text(json.dumps(rank_main(folder, kl_coef, precision)))
        return
    parser = argument_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: every code path, measuring nothing")
    args = parser.parse_args()
    if args.render:
        result = load_json(args.render)
        write_outputs(args.out / "loading", result, render, plot)
        return
    check_smoke_out(parser, args)
    shape = SMOKE if args.smoke else LOADING_MODEL
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        model_bytes = write_model(folder, shape)
        runs = [{"kl_coef": kl_coef, "precision": precision, "ranks": measure(folder, kl_coef, precision)}
                for kl_coef, precision in RUNS]
    result = {"smoke": args.smoke, "command": command_line("loading"), "machine": machine_info(), "code": code_version(),
              "shape": shape, "parameters": model_bytes // 4, "model_float32_bytes": model_bytes, "runs": runs}
    save_json(args.out / "loading.json", result)
    write_outputs(args.out / "loading", result, render, plot)


if __name__ == "__main__":
    main()
