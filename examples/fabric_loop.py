"""A Fabric training loop with LoGRA: set up the model, then the optimizer, then loop.

    python examples/fabric_loop.py              # 1 CPU process
    python examples/fabric_loop.py --devices 2  # 2 CPU processes (gloo), weights row-sharded
"""

import argparse

import lightning as L
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import lightning_logra


class TinyLM(torch.nn.Module):
    def __init__(self, vocab_size: int = 32) -> None:
        super().__init__()
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        self.model = Qwen2ForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    logra = lightning_logra.LoGRAConfig(rank=16, update_ratio=2e-2, kl_budget=2e-2, kl_budget_final=5e-3, schedule_steps=args.steps)
    strategy = lightning_logra.LoGRAFabricStrategy(logra=logra)
    logger = L.fabric.loggers.CSVLogger("lightning_logs", name="fabric_loop")
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, loggers=logger)
    fabric.launch()
    fabric.seed_everything(0)

    with fabric.init_module(empty_init=True):
        lm = TinyLM()  # on the meta device: no rank holds the whole model
    model = fabric.setup_module(lm)  # FSDP2 shards it over 2+ devices, then each rank initialises its shard
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(args.steps):
        starts = torch.randint(0, 32, (16, 1), generator=generator)
        batch = (starts + torch.arange(24) * 3) % 32  # a learnable cyclic pattern
        loss = model(batch)
        fabric.backward(loss)
        # The LoGRA update of the targets, scaled to the KL budget on the probe handed down
        # (here the batch itself); the report says what it did: predicted KL, alpha, timings.
        probe = lightning_logra.ProbeBatch.from_token_batch(batch)
        report = strategy.logra_step(optimizer, lightning_logra.LoGRAStepInputs(probe=probe))
        optimizer.zero_grad()
        fabric.log_dict({"loss": loss.item(), **report.metrics()}, step=step)
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {loss.item():.3f}  alpha {report.alpha:.3f}  "
                         f"predicted KL {report.predicted_kl_scaled:.2e} (budget {report.budget:.2e})")


if __name__ == "__main__":
    main()
