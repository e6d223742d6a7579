"""PreemptionCheckpoint: a run told to stop saves a checkpoint at the end of its step, then
exits, so that a restart resumes where it stopped.

Spot instances and Kubernetes send SIGTERM before they kill; SLURM sends its requeue signal
(SIGUSR1 unless set otherwise) before the time limit. Lightning 2.6 on its own: a SIGTERM
ends the run after the current batch without a checkpoint (and one arriving during
validation ends it there); with several processes its handler broadcasts from inside the
signal handler, which deadlocks when the signal finds another rank waiting in a collective
(FSDP's all-gathers); with SLURM's auto-requeue it saves from inside the handler, in the
middle of a step. So during fit this callback handles both signals itself: its handler
only notes the signal (and forwards it, as Lightning's does, to the processes Lightning
launched); at the end of the step, or of a validation run, the ranks agree, save
Lightning's HPC checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``: SLURM restarts resume
from it by themselves, others with ``ckpt_path="hpc"``) through the strategy like every
save, requeue the SLURM job as Lightning does, and raise ``Preempted``. Lightning puts its
own handlers back at the end of fit.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

EXIT_STATUS = 128 + signal.SIGTERM  # 143: what a shell reports for a process that SIGTERM ended
NO_REQUEST, TERMINATE, REQUEUE = 0, 1, 2  # ordered: the ranks agree on the largest


class Preempted(SIGTERMException):
    """Raised on every rank once the preemption checkpoint is in place. Uncaught, it exits
    with status 143, so that restart policies (Kubernetes' ``restartPolicy: OnFailure``,
    ``torchrun --max-restarts``, a job script's ``|| requeue``) see a run that did not
    finish. A subclass of Lightning's ``SIGTERMException``: callbacks' ``on_exception``
    see it as Lightning's own stop."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(EXIT_STATUS)
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint


class PreemptionCheckpoint(Callback):
    """On SIGTERM, or on SLURM's requeue signal under Lightning's SLURM auto-requeue: at
    the end of the current optimizer step (the batch that steps, when gradients are
    accumulated over several) or validation run, the same one on every rank,
    save ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, requeue the SLURM job (requeue signal
    only) and stop with ``Preempted`` (exit status 143); ``RunSummary`` prints its table
    then. ``logra fit`` adds it; list it after the other callbacks, whose
    ``on_train_batch_end`` then still runs for the step. In the run's last step too:
    Lightning would stop before its end-of-training hooks all the same, and the
    checkpoint holds the final weights (a resume from it has no step left)."""

    def __init__(self) -> None:
        self._agreement: dist.ProcessGroup | None = None
        self._requeue_signal: int | None = None
        self._request = NO_REQUEST
        self._last_step = 0

    def checkpoint_folder(self, trainer) -> Path:
        """Where it saves (``default_root_dir``): the strategy holds this folder's writer lock
        and recovers it at start-up (``strategies.checkpoints.recovery``)."""
        return Path(trainer.default_root_dir)

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._request = NO_REQUEST
        if stage == "fit" and dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            # Its own gloo group: CPU tensors (no device sync each step), apart from the
            # collectives of the training step.
            self._agreement = dist.new_group(backend="gloo")

    # Lightning registers its handlers just before the sanity check and training: take over after it.
    @override
    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._handle_signals(trainer)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        self._handle_signals(trainer)

    def _handle_signals(self, trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; Lightning's handlers stay
        # Lightning's own cluster environment, as its signal connector reads it.
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self._requeue_signal = environment.requeue_signal
            signal.signal(self._requeue_signal, lambda signum, frame: self._note(trainer, signum, REQUEUE))
        signal.signal(signal.SIGTERM, lambda signum, frame: self._note(trainer, signum, TERMINATE))

    def _note(self, trainer, signum: int, request: int) -> None:
        """The handler: no collective, no file; the step goes on."""
        first = self._request == NO_REQUEST
        self._request = max(self._request, request)
        rank_zero_info(f"Received {signal.Signals(signum).name}: the run stops after this step, with a checkpoint")
        if first and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the processes Lightning launched, as its handler does

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # a batch that accumulated gradients for the step: its checkpoint would lose them
        self._last_step = trainer.global_step
        self._stop_if_requested(trainer)

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._stop_if_requested(trainer)

    def _stop_if_requested(self, trainer) -> None:
        request = self._agreed_request()
        if request == NO_REQUEST:
            return
        checkpoint = Path(trainer.strategy.broadcast(_CheckpointConnector.hpc_save_path(trainer.default_root_dir)))
        if request == REQUEUE:
            # Lightning's SLURM handler, at the end of the step: it saves to that same path and
            # requeues the job (global rank 0).
            trainer._signal_connector._slurm_sigusr_handler_fn(self._requeue_signal, None)
            name = signal.Signals(self._requeue_signal).name
        else:
            trainer.save_checkpoint(checkpoint, weights_only=False)  # whole, said so: Lightning logs a default
            name = "SIGTERM"
        raise Preempted(name, trainer.global_step, checkpoint)

    def _agreed_request(self) -> int:
        """This rank's request, or the largest of all ranks' (one all-reduce of one integer),
        so that every rank stops at the same point, whichever ranks the signal reached."""
        if self._agreement is None:
            return self._request
        agreed = torch.tensor([self._request])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._agreement)
        return int(agreed.item())
