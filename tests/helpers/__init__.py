"""What tests share, one module per layer (as the test folders mirror the package):

- ``models``: tiny random Hugging Face models, a byte-level tokenizer, fixed inputs for them.
- ``core``: plain-torch models, LoGRAOptimizer builders, one-step and probe builders.
- ``lightning``: a plain causal-LM LightningModule, its data, Trainer/Fabric runs, and the
  plain-torch reference the strategies must reproduce.
- ``grpo``: GRPOModule builders and runs, reward functions named by import path
  (``"tests.helpers.grpo:varied_reward"``), the reference-model and export runs.
- ``distributed``: run a function on 2 gloo processes; a subprocess's environment.
- ``chaos_rewards``: reward functions that misbehave in every way RewardRunner must survive
  (hang, hold the GIL, raise, wrong length, NaN, past float32, generators, non-lists).
- ``rollouts``: synthetic rollout batches of chosen lengths and their micro-batching settings.

A builder lives here when more than one test file uses it, or when several test files had
one of the same name (each then has a name that says how it differs). A file's own
harness (a ``fit`` or ``run`` with options only that file uses) stays in the file.
"""
