"""The quickstart from Python: GRPO on small arithmetic with LoGRA, SmolLM2-135M, CPU.

    python examples/grpo_math.py
"""

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.callbacks import RunSummary, StepProgressBar
from lightning_logra.cli import default_tracking_uri
from lightning_logra.data import PromptDataModule
from lightning_logra.modules import BatchingConfig, GRPOModule, OptimizerConfig, RolloutConfig

L.seed_everything(0)
policy = GRPOModule(
    model="smollm2-135m-instruct",
    rollout=RolloutConfig(num_generations=8, max_new_tokens=16, val_generations=4),
    optimizer=OptimizerConfig(warmup_steps=0, decay_steps=0),
    batching=BatchingConfig(micro_batch_size=16),
    activation_checkpointing=False,
)
data = PromptDataModule(train="arithmetic:1", val="arithmetic:1", tokenizer="smollm2-135m-instruct",
                        instruction=" Answer with just the number.", batch_size=4, train_size=512, val_size=24)
trainer = L.Trainer(
    accelerator="cpu",
    strategy=LoGRAFSDPStrategy(logra=LoGRAConfig(rank="auto", kl_budget=2e-3, kl_budget_final=5e-4, schedule_steps=12)),
    callbacks=[LoGRACallback(), RunSummary(), StepProgressBar()],
    logger=MLFlowLogger(experiment_name="quickstart", run_name="logra-python", tracking_uri=default_tracking_uri()),
    max_steps=12, val_check_interval=6, check_val_every_n_epoch=None, num_sanity_val_steps=0,
    log_every_n_steps=1, enable_checkpointing=False,
)
trainer.fit(policy, data)
