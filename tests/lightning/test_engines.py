"""modules/engines.py: the module keeps its rollout engine in step with training, in full
or by the LoGRA updates each optimizer step returned."""

from types import SimpleNamespace

import pytest
from torch import nn

from lightning_logra.modules.engines import step_low_rank_updates, sync_engine
from lightning_logra.rollout.config import RolloutConfig


class RecordingEngine:
    def __init__(self) -> None:
        self.syncs = []

    def sync_weights(self, policy, low_rank_updates=None) -> None:
        self.syncs.append((policy, low_rank_updates))


def test_a_full_sync_sends_the_policy_whatever_was_received():
    engine, policy = RecordingEngine(), nn.Linear(2, 2)
    sync_engine(engine, policy, RolloutConfig(), updates=2, received=[])
    assert engine.syncs == [(policy, None)]


def test_a_lowrank_sync_sends_every_received_update_in_order():
    engine, policy = RecordingEngine(), nn.Linear(2, 2)
    sync_engine(engine, policy, RolloutConfig(engine="vllm", weight_sync="lowrank"), updates=2,
                received=[["a", "b"], ["c"]])
    assert engine.syncs == [(policy, ["a", "b", "c"])]


def test_a_lowrank_sync_refuses_a_step_whose_update_did_not_reach_it():
    with pytest.raises(ValueError, match=r"weight_sync='lowrank'.*2 steps ran, 1 reported one"):
        sync_engine(RecordingEngine(), nn.Linear(2, 2), RolloutConfig(engine="vllm", weight_sync="lowrank"),
                    updates=2, received=[["a"]])


def test_the_low_rank_updates_come_from_the_report_the_step_returned():
    assert step_low_rank_updates(SimpleNamespace(low_rank_updates=("u1", "u2")), strategy=None) == ["u1", "u2"]
    assert step_low_rank_updates(SimpleNamespace(low_rank_updates=None), strategy=None) == []  # a skipped step


def test_low_rank_updates_under_a_dense_strategy_name_it():
    class DDPStrategy:
        pass

    with pytest.raises(ValueError, match="needs every optimizer step to be a LoGRA update.*DDPStrategy"):
        step_low_rank_updates(None, DDPStrategy())
