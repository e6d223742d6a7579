"""LoGRA in a plain torch loop, KL control included: no Lightning.

    python examples/torch_loop.py

A tiny random Qwen2 learns to continue a cyclic token pattern; every step is scaled so that
its predicted KL on the batch equals the budget.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_logra import LoGRAConfig, LoGRAOptimizer, LoGRAStepInputs, ProbeBatch

torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=16, update_ratio=2e-2, kl_budget=2e-2, kl_budget_final=5e-3, schedule_steps=30))
generator = torch.Generator().manual_seed(0)
for step in range(30):
    batch = (torch.randint(0, 32, (16, 1), generator=generator) + torch.arange(24) * 3) % 32
    optimizer.zero_grad()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    report = optimizer.step(logra_inputs=LoGRAStepInputs(probe=ProbeBatch.from_token_batch(batch)))
    if step % 5 == 0 or step == 29:
        print(f"step {step:2d}  loss {loss.item():.3f}  alpha {report.alpha:.3f}  "
              f"predicted KL {report.predicted_kl_scaled:.2e} (budget {report.budget:.2e})")
