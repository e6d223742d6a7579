"""On one device logra_fsdp leaves the policy unwrapped (plain parameters, no FSDP2 hooks),
and Fabric's checkpoint semantics hold without FSDP2: modules, optimizers and metadata."""

import warnings

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_logra import LoGRAFabricStrategy, LoGRAFSDPStrategy
from tests.helpers.lightning import CausalLM, config, loader, trainer


class Counter:
    """A ``Stateful`` object, as users put in ``fabric.save``'s state."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def assert_unwrapped(module):
    assert not any(isinstance(parameter, DTensor) for parameter in module.parameters())
    assert not any(isinstance(submodule, FSDPModule) for submodule in module.modules())


def fabric_setup():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LoGRAFabricStrategy(logra=config()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric.launch()
        model = fabric.setup_module(CausalLM())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return fabric, model, optimizer


def test_trainer_on_one_device_trains_plain_parameters(tmp_path):
    module = CausalLM()
    strategy = LoGRAFSDPStrategy(logra=config())
    trainer(strategy, max_steps=1, tmp_path=tmp_path).fit(module, loader(4))
    assert strategy.logra_optimizer.update_count == 1
    assert_unwrapped(module)


def test_fabric_on_one_device_sets_up_plain_parameters_on_its_device():
    fabric, model, _ = fabric_setup()
    assert_unwrapped(model)
    assert all(parameter.device == fabric.device for parameter in model.parameters())


def test_fabric_load_restores_modules_and_stateful_objects_in_place_and_returns_the_rest(tmp_path):
    fabric, model, optimizer = fabric_setup()
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "counter": Counter(7), "step": 3, "note": "x"})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    counter = Counter()
    state = {"model": model, "optimizer": optimizer, "counter": counter, "step": 0}
    remaining = fabric.load(tmp_path / "ckpt", state)
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
    assert counter.value == 7 and state["step"] == 3
    assert remaining == {"note": "x"}


def test_fabric_load_of_missing_metadata_fails_unless_not_strict(tmp_path):
    fabric, model, _ = fabric_setup()
    fabric.save(tmp_path / "ckpt", {"model": model})
    with pytest.raises(KeyError, match="LoGRAFabricStrategy: the checkpoint has no 'step'; load with strict=False"):
        fabric.load(tmp_path / "ckpt", {"model": model, "step": 0})
    state = {"model": model, "step": 5}
    fabric.load(tmp_path / "ckpt", state, strict=False)
    assert state["step"] == 5


def test_fabric_save_with_a_filter_names_the_fix(tmp_path):
    fabric, model, _ = fabric_setup()
    with pytest.raises(NotImplementedError, match="LoGRAFabricStrategy saves whole state dicts.*drop filter="):
        fabric.save(tmp_path / "ckpt", {"model": model}, filter={"model": lambda name, value: True})
    assert not (tmp_path / "ckpt").exists()


def test_fabric_save_of_an_optimizer_without_its_model_names_the_fix(tmp_path):
    fabric, _, optimizer = fabric_setup()
    with pytest.raises(ValueError, match="optimizer 'optimizer' steps parameters of no module.*'model': model"):
        fabric.save(tmp_path / "ckpt", {"optimizer": optimizer})


def test_fabric_load_raw_reads_a_plain_weights_file(tmp_path):
    fabric, model, _ = fabric_setup()
    torch.save({name: torch.zeros_like(value) for name, value in model.state_dict().items()}, tmp_path / "weights.pt")
    fabric.load_raw(tmp_path / "weights.pt", model)
    assert not any(value.any() for value in model.state_dict().values())
