"""A rollout engine in a process of its own, for one-step-off-policy training
(``rollout.max_staleness > 0``): it samples the next batch while the trainer trains on this one.

The worker holds its own float32 copy of the policy and the configured engine on it (the
HF engine samples from the copy; vLLM reloads it after each update and proves the reload
against it, as it does against the trainer in one process). The trainer
sends it the initial weights once (``load``), then after every training step only what the
step changed (``update``): a LoGRA step's ``LowRankUpdate`` list (alpha D and the seed of A,
about rank / width of the weights), else the trainable weights (every weight for dense
AdamW, the adapters for LoRA). The worker applies a low-rank update with the trainer's own
arithmetic (``LowRankUpdate.apply_to``), so on one device its copy stays equal to the
trainer's bit for bit. Requests run in the order sent: a batch requested after an update
is sampled from the updated weights. Each reply carries the policy version that sampled it.

Tensors travel through ``torch.multiprocessing`` queues in shared memory; what is sent is a
copy, since the trainer goes on changing its weights while the worker reads.
"""

from __future__ import annotations

import queue
import traceback
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from lightning_logra.core.lowrank import LowRankUpdate
from lightning_logra.core.projection import canonical_name
from lightning_logra.rollout.base import Rollouts, check_request
from lightning_logra.rollout.config import RolloutConfig

POLL_SECONDS = 1.0  # how often a wait for the worker checks that it is still alive


class RolloutWorkerError(RuntimeError):
    """The rollout worker process failed or died; the message holds its traceback or exit code."""


class RolloutWorker:
    """The trainer's handle on the worker process. ``model_source`` and ``tokenizer`` build
    the worker's copy as the policy was built (``lora``: with the same adapters), on the
    CPU, with ``threads`` torch threads (None: torch's default); ``config.engine`` samples
    from it (vLLM: reloaded from the copy after every update and checked, ``seed`` its own)."""

    def __init__(self, model_source: str, tokenizer, config: RolloutConfig, *, lora=None,
                 threads: int | None = None, seed: int = 0) -> None:
        context = mp.get_context("spawn")
        self._requests, self._replies = context.Queue(), context.Queue()
        self._process = context.Process(target=_serve, name="logra-rollout-worker", daemon=True,
                                        args=(self._requests, self._replies, model_source, tokenizer, config, lora,
                                              threads, seed))
        self._process.start()
        self._ready: dict[object, tuple] = {}  # replies that arrived before they were asked for
        self._dropped: set[object] = set()
        self.last_sync_bytes: int | None = None
        self._wait_for("ready")

    def load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Every weight, by name (wrapper components are ignored); the worker's policy becomes ``version``."""
        self.update([], weights, version)

    def update(self, low_rank: list[LowRankUpdate], weights: Mapping[str, torch.Tensor], version: int) -> None:
        """What a training step changed: its LoGRA updates (``low_rank``) and the new values of the
        weights it trained otherwise (``weights``, by name); the worker's policy becomes ``version``."""
        updates = [replace(update, name=canonical_name(update.name), factor=update.factor.detach().to("cpu", copy=True))
                   for update in low_rank]
        copies = {canonical_name(name): tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}
        self.last_sync_bytes = (sum(update.nbytes for update in updates)
                                + sum(t.numel() * t.element_size() for t in copies.values()))
        self._send("update", updates, copies, version)

    def submit(self, key, prompts: list[str], *, num_generations: int, seed: int) -> None:
        """Ask for ``num_generations`` samples of each prompt, drawn with torch seeded by ``seed``."""
        check_request(prompts, num_generations)
        self._send("generate", key, list(prompts), num_generations, seed)

    def receive(self, key) -> tuple[Rollouts, int]:
        """The rollouts asked for under ``key`` and the policy version that sampled them (waits)."""
        while key not in self._ready:
            other = self._file_rollouts(self._next_reply())
            if other is not None:
                raise RolloutWorkerError(f"the rollout worker answered {other[0]!r} while rollouts were awaited")
        return self._ready.pop(key)

    def drop(self, key) -> None:
        """Forget a request: its rollouts are thrown away when they arrive."""
        if self._ready.pop(key, None) is None:
            self._dropped.add(key)

    def weights(self) -> dict[str, torch.Tensor]:
        """The worker's current weights by canonical name, after every request sent before."""
        self._send("weights")
        return self._wait_for("weights")[0]

    def close(self) -> None:
        """Stop the process (what it was generating is lost)."""
        if self._process.is_alive():
            try:
                self._requests.put(("stop",))
            except (OSError, ValueError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._requests.close()
        self._replies.close()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def _send(self, *message) -> None:
        if not self._process.is_alive():
            raise RolloutWorkerError(f"the rollout worker has exited (code {self._process.exitcode})")
        self._requests.put(message)

    def _wait_for(self, expected: str) -> tuple:
        while True:
            reply = self._file_rollouts(self._next_reply())
            if reply is not None and reply[0] == expected:
                return tuple(reply[1:])

    def _file_rollouts(self, reply: tuple) -> tuple | None:
        """Keep a reply of rollouts for ``receive`` (or throw it away if dropped); any other reply is returned."""
        if reply[0] != "rollouts":
            return reply
        key, *answer = reply[1:]
        if key in self._dropped:
            self._dropped.discard(key)
        else:
            self._ready[key] = tuple(answer)
        return None

    def _next_reply(self) -> tuple:
        while True:
            try:
                reply = self._replies.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RolloutWorkerError(f"the rollout worker died (exit code {self._process.exitcode}); "
                                             "a code of -9 usually means it ran out of memory") from None
                continue
            if reply[0] == "error":  # the worker exits after sending it
                self._process.join(timeout=10)
                raise RolloutWorkerError(f"the rollout worker failed:\n{reply[1]}")
            return reply


def _serve(requests, replies, model_source: str, tokenizer, config: RolloutConfig, lora, threads: int | None,
           seed: int) -> None:
    """The worker process: build the policy copy and its engine, then answer requests in order."""
    try:
        import transformers

        from lightning_logra.models import build_model, with_lora
        from lightning_logra.rollout.engines import build_engine

        if threads is not None:
            torch.set_num_threads(threads)
        # from_pretrained's "Loading weights" bar would cut into the trainer's progress bar mid-run
        transformers.utils.logging.disable_progress_bar()
        model = build_model(model_source, tokenizer, empty=False, train=False)
        if lora is not None:
            model = with_lora(model, lora).eval()
        model.requires_grad_(False)
        engine = build_engine(replace(config, weight_sync="full"), model, tokenizer, seed=seed)
        weights = {canonical_name(name): tensor for name, tensor in model.named_parameters()}
        version = None
        replies.put(("ready",))
        while True:
            kind, *payload = requests.get()
            if kind == "stop":
                return
            if kind == "update":
                updates, received, version = payload
                unknown = sorted(({u.name for u in updates} | set(received)) - set(weights))
                if unknown:
                    raise KeyError(f"weights the worker's model does not have: {unknown[:5]}")
                with torch.no_grad():
                    for update in updates:
                        update.apply_to(weights[update.name])
                    for name, tensor in received.items():
                        weights[name].copy_(tensor)
                engine.sync_weights(model)  # vLLM reloads the copy and checks it; the HF engine samples from it
            elif kind == "generate":
                key, prompts, num_generations, seed = payload
                torch.manual_seed(seed)
                replies.put(("rollouts", key, engine.generate(prompts, num_generations=num_generations), version))
            elif kind == "weights":
                replies.put(("weights", {name: tensor.detach().clone() for name, tensor in weights.items()}))
    except BaseException:  # noqa: BLE001 - everything goes back to the trainer, which raises it
        replies.put(("error", traceback.format_exc()))
