"""One-step-off-policy rollouts (``rollout.max_staleness``): what the trainer asks the worker
for and when (``modules/async_rollouts.py``, with a recording worker), and whole fits with
the real worker process: its weights equal the trainer's after every step, the first step
equals the synchronous run's, a resume equals the uninterrupted run, a fit that raises stops
the worker."""

import warnings

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.data import PromptDataModule
from lightning_logra.modules import LoRAConfig, LossConfig, RolloutConfig
from lightning_logra.modules.async_rollouts import AsyncRollouts
from lightning_logra.rollout.config import RolloutConfig as Config
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import WorkerMirror, grpo_module

# -- What is asked for, and when --


class RecordingWorker:
    """Answers each request with the version its weights had when the request was queued."""

    def __init__(self) -> None:
        self.calls, self.version, self.queued = [], None, {}
        self.last_sync_bytes = 0

    def load(self, weights, version):
        self.calls.append(("load", version))
        self.version = version

    def update(self, low_rank, weights, version):
        self.calls.append(("update", version))
        self.version = version

    def submit(self, key, prompts, *, num_generations, seed):
        self.calls.append(("submit", key, seed))
        self.queued[key] = (f"rollouts of {prompts}", self.version)

    def receive(self, key):
        self.calls.append(("receive", key))
        return self.queued.pop(key)

    def drop(self, key):
        self.calls.append(("drop", key))
        self.queued.pop(key)


def batches(*names):
    return [{"prompt_text": [name]} for name in names]


def pipeline(worker, max_staleness=1):
    return AsyncRollouts(lambda: worker, max_staleness=max_staleness, num_generations=2, seed_of=lambda i: 100 + i)


def test_the_next_batch_is_asked_for_before_this_one_is_awaited_and_trains_one_version_late():
    worker, loader = RecordingWorker(), batches("a", "b", "c")
    rollouts = pipeline(worker)
    policy = torch.nn.Linear(1, 1)
    assert rollouts.rollouts(loader[0], index=0, epoch=0, loader=loader, last_index=None, policy=policy) == \
        ("rollouts of ['a']", 0)
    rollouts.sync(policy, [], version=1)
    assert rollouts.rollouts(loader[1], index=1, epoch=0, loader=loader, last_index=None, policy=policy) == \
        ("rollouts of ['b']", 0)  # sampled while step 0 trained: one step stale
    rollouts.sync(policy, [], version=2)
    assert rollouts.rollouts(loader[2], index=2, epoch=0, loader=loader, last_index=None, policy=policy) == \
        ("rollouts of ['c']", 1)
    assert worker.calls == [("load", 0), ("submit", 0, 100), ("submit", 1, 101), ("receive", 0), ("update", 1),
                            ("submit", 2, 102), ("receive", 1), ("update", 2), ("receive", 2)]


def test_nothing_is_asked_for_past_the_last_step_nor_past_the_epoch():
    worker, loader = RecordingWorker(), batches("a", "b")
    rollouts, policy = pipeline(worker, max_staleness=2), torch.nn.Linear(1, 1)
    rollouts.rollouts(loader[0], index=0, epoch=0, loader=loader, last_index=None, policy=policy)
    assert [call for call in worker.calls if call[0] == "submit"] == [("submit", 0, 100), ("submit", 1, 101)]
    rollouts.rollouts(loader[1], index=1, epoch=0, loader=loader, last_index=None, policy=policy)
    worker.calls.clear()
    # The next epoch starts a new pass, whose first batch waits for its own generation.
    rollouts.rollouts(loader[0], index=2, epoch=1, loader=loader, last_index=2, policy=policy)
    assert worker.calls == [("submit", 2, 102), ("receive", 2)]


def test_batches_asked_for_in_an_epoch_that_ended_early_are_dropped():
    worker, loader = RecordingWorker(), batches("a", "b", "c")
    rollouts, policy = pipeline(worker), torch.nn.Linear(1, 1)
    rollouts.rollouts(loader[0], index=0, epoch=0, loader=loader, last_index=None, policy=policy)  # asks for "b" too
    assert rollouts.rollouts(loader[0], index=1, epoch=1, loader=loader, last_index=None, policy=policy)[0] == \
        "rollouts of ['a']"
    assert ("drop", 1) in worker.calls


def test_a_batch_other_than_the_loaders_next_is_refused():
    worker, loader = RecordingWorker(), batches("a", "b")
    with pytest.raises(RuntimeError, match="other prompts than the train loader's order gave"):
        pipeline(worker).rollouts({"prompt_text": ["z"]}, index=0, epoch=0, loader=loader, last_index=None,
                                  policy=torch.nn.Linear(1, 1))


# -- Settings that cannot work --


@pytest.mark.parametrize(("options", "match"), [
    ({"dynamic_sampling": True}, "0 with dynamic_sampling"),
    ({"worker_threads": 0}, "worker_threads = 0 is invalid"),
])
def test_rollout_settings_that_one_step_off_cannot_serve_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        Config(max_staleness=1, **options)


def test_one_step_off_without_importance_sampling_is_refused(model_folder):
    with pytest.raises(ValueError, match=r"loss\.tis = False is invalid: must be true or None with "
                                         r"rollout\.max_staleness = 1"):
        grpo_module(model_folder, rollout=RolloutConfig(num_generations=2, max_new_tokens=6, max_staleness=1),
                    loss=LossConfig(tis=False))


def test_one_step_off_tool_rollouts_are_refused(model_folder):
    with pytest.raises(ValueError, match="single-turn rollouts only"):
        grpo_module(model_folder, rollout=RolloutConfig(num_generations=2, max_new_tokens=6, max_staleness=1),
                    tools=["tests.helpers.tools:add"])


# -- Whole fits with the worker process (a process each: integration tests) --


def data(folder, train_size=16):
    return PromptDataModule(train="arithmetic", val="arithmetic", tokenizer=folder, batch_size=2, train_size=train_size,
                            val_size=4)


def fit(module, folder, strategy="auto", steps=3, callbacks=(), train_size=16, ckpt_path=None,
        enable_checkpointing=False, devices=1):
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=enable_checkpointing, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data(folder, train_size), ckpt_path=ckpt_path)
    return trainer


def one_step_off(folder, **overrides):
    rollout = RolloutConfig(num_generations=2, max_new_tokens=6, max_staleness=1, worker_threads=torch.get_num_threads())
    return grpo_module(folder, rollout=rollout, **overrides)


def logra():
    return LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))


@pytest.mark.integration
def test_under_logra_the_worker_follows_each_step_by_its_low_rank_update_bit_for_bit(model_folder):
    mirror, module = WorkerMirror(), one_step_off(model_folder)
    fit(module, model_folder, logra(), callbacks=[mirror])
    assert mirror.gaps == [0.0, 0.0, 0.0]
    assert mirror.staleness == [0.0, 1.0, 1.0]  # the first batch waits; the others were sampled a step earlier
    targets = [p for n, p in module.policy.named_parameters() if n.endswith("proj.weight")]
    # Per target: the factor alpha D (rows x rank 8, float32) and the 8-byte seed of A.
    assert mirror.sync_bytes == [float(sum(p.shape[0] * 8 * 4 + 8 for p in targets))] * 3
    assert module._async is None  # the worker stops with the fit


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("method", ["dense", "lora"])
def test_dense_and_lora_workers_receive_the_trained_weights_bit_for_bit(model_folder, method):
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) if method == "lora" else None
    mirror, module = WorkerMirror(), one_step_off(model_folder, lora=lora)
    fit(module, model_folder, callbacks=[mirror])
    assert mirror.gaps == [0.0, 0.0, 0.0]
    assert mirror.staleness == [0.0, 1.0, 1.0]
    trained = sum(p.numel() * 4 for p in module.policy.parameters() if p.requires_grad)
    assert mirror.sync_bytes == [float(trained)] * 3  # every weight for dense, the adapters for LoRA


@pytest.mark.integration
def test_the_first_step_equals_the_synchronous_runs(model_folder):
    """Step 0's batch is sampled from the same weights with the same seed in the worker as in
    this process: one step of each mode ends at the same weights."""
    synchronous = grpo_module(model_folder, loss=LossConfig(tis=True))
    asynchronous = one_step_off(model_folder)
    fit(synchronous, model_folder, logra(), steps=1)
    fit(asynchronous, model_folder, logra(), steps=1)
    ours = dict(asynchronous.policy.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in synchronous.policy.named_parameters())


class RaiseAfterFirstStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.worker = pl_module._async.worker._process  # running, a batch sampled ahead
        raise RuntimeError("a fit that fails after its first step")


@pytest.mark.integration
def test_a_fit_that_raises_stops_the_worker(model_folder):
    failing, module = RaiseAfterFirstStep(), one_step_off(model_folder)
    with pytest.raises(RuntimeError, match="a fit that fails after its first step"):
        fit(module, model_folder, callbacks=[failing])
    assert module._async is None and not failing.worker.is_alive()


@pytest.mark.integration
def test_a_resume_equals_the_uninterrupted_run_with_the_same_schedule(model_folder, tmp_path):
    """4 prompts, 2 per step: an epoch is 2 steps, and the pipeline restarts with each epoch as
    it does on a resume. Resuming from the checkpoint written after epoch 0 (in-flight batches
    dropped, the version and data position restored) ends at the uninterrupted run's weights."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    uninterrupted, mirror = one_step_off(model_folder), WorkerMirror()
    fit(uninterrupted, model_folder, steps=4, train_size=4, callbacks=[checkpoints, mirror], enable_checkpointing=True)
    assert mirror.staleness == [0.0, 1.0, 0.0, 1.0]
    resumed, mirror = one_step_off(model_folder), WorkerMirror()
    fit(resumed, model_folder, steps=4, train_size=4, callbacks=[mirror], ckpt_path=tmp_path / "step=2.ckpt")
    assert mirror.staleness == [0.0, 1.0] and mirror.gaps == [0.0, 0.0]
    ours = dict(resumed.policy.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in uninterrupted.policy.named_parameters())


def _two_ranks_one_step_off(rank, world, folder):
    mirror = WorkerMirror()
    fit(one_step_off(folder), folder, logra(), steps=3, callbacks=[mirror], devices=2)
    return mirror.gaps, mirror.staleness


@pytest.mark.distributed
def test_on_two_processes_each_rank_feeds_its_own_worker(model_folder):
    """Each rank samples its own prompts in its own worker; LoGRA's factors are gathered by
    rows and applied to whole weights there, the trainer's to row shards: the same updates,
    rounded differently (hence a tolerance; one process is exact)."""
    (gaps0, staleness0), (gaps1, staleness1) = run_lightning_on_two_ranks(_two_ranks_one_step_off, model_folder)
    assert staleness0 == staleness1 == [0.0, 1.0, 1.0]
    assert max(gaps0 + gaps1) <= 1e-6
