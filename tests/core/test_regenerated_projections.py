"""``regenerate_projections``: no A is kept; every use draws it again from its seed. The
updates, predictions and step sizes must be those of stored projections bit for bit."""

import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAOptimizer, LoGRAStepInputs, ProbeBatch, memory_report
from lightning_logra.core.projection import Projection, make_projection
from lightning_logra.models.loading import enable_activation_checkpointing
from tests.helpers.core import tokens_4x10
from tests.helpers.models import tiny_qwen2

CASES = {
    "plain": ({}, False, False),
    "shared, kept A": ({"share_projection_by_input": True, "redraw_projections": False}, False, False),
    "checkpointed": ({}, True, False),
    "bf16 autocast, rank 16": ({"rank": 16}, False, True),
}


def run(regenerate: bool, overrides: dict, checkpointed: bool, autocast: bool, steps: int = 3, device: str = "cpu"):
    model = tiny_qwen2().to(device).train()
    if checkpointed:
        enable_activation_checkpointing(model)
    config = LoGRAConfig(**{"rank": 8, "update_ratio": 1e-2, "kl_budget": 1e-4, "kl_budget_final": 1e-5,
                            "schedule_steps": 4, "regenerate_projections": regenerate, **overrides})
    optimizer = LoGRAOptimizer(model, config)
    reports = []
    for step in range(steps):
        optimizer.zero_grad()
        batch = tokens_4x10(step).to(device)
        for rows in (batch[:2], batch[2:]):  # two micro-batches
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            report = optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)))
        reports.append((report.alpha, report.predicted_kl, report.update_norm, report.measured_kl))
    return model, optimizer, reports


@pytest.mark.parametrize("case", list(CASES))
def test_regenerated_projections_step_exactly_as_stored_ones(case):
    overrides, checkpointed, autocast = CASES[case]
    stored_model, stored, stored_reports = run(False, overrides, checkpointed, autocast)
    model, regenerated, reports = run(True, overrides, checkpointed, autocast)
    assert reports == stored_reports and all(alpha > 0 for alpha, *_ in reports)
    for (name, a), (_, b) in zip(model.state_dict().items(), stored_model.state_dict().items()):
        assert torch.equal(a, b), name
    # Nothing kept between uses, and the same A wherever the stored run has one.
    assert all(state.source.stored is None for state in regenerated.sketches)
    assert regenerated.state_bytes()["projections"] == 0 < stored.state_bytes()["projections"]
    for state, kept in zip(regenerated.sketches, stored.sketches):
        assert torch.equal(state.projection, kept.projection)


@pytest.mark.gpu
def test_regenerated_projections_step_exactly_as_stored_ones_on_cuda():
    # Drawn on the CPU, copied to the device at each use (the update through its CPU bits buffer).
    stored_model, _, stored_reports = run(False, {"rank": 16}, True, True, device="cuda")
    model, _, reports = run(True, {"rank": 16}, True, True, device="cuda")
    assert reports == stored_reports
    for (name, a), (_, b) in zip(model.state_dict().items(), stored_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_memory_report_counts_no_projection_and_one_draw_when_regenerated():
    model = tiny_qwen2()
    stored = memory_report(model, LoGRAConfig(rank=8))
    regenerated = memory_report(model, LoGRAConfig(rank=8, regenerate_projections=True))
    assert regenerated.projection_bytes == 0 < stored.projection_bytes and stored.projection_draw_bytes == 0
    widest = max(module.in_features for name, module in model.named_modules() if name.endswith("down_proj"))
    assert regenerated.projection_draw_bytes == widest * 8 * (1 + 4)  # uint8 bits + float32 A
    assert stored.logra_state_bytes - regenerated.logra_state_bytes == stored.projection_bytes


def test_a_projection_drawn_into_a_buffer_equals_the_allocated_draw():
    bits = torch.empty(16 * 40 + 5, dtype=torch.uint8)  # larger than needed
    for dtype in (torch.float32, torch.float64):
        projection = Projection.draw(16, 33, seed=11, device=torch.device("cpu"), dtype=torch.bfloat16,
                                     distribution="rademacher", regenerate=True)
        out = torch.full((16, 40), float("nan"), dtype=dtype)[:, :33]  # a strided view, as the update uses
        assert torch.equal(projection.draw_into(out, bits), make_projection(16, 33, 11, dtype=dtype))


def test_regeneration_is_refused_for_gaussian_projections():
    with pytest.raises(ValueError, match="regenerate_projections"):
        LoGRAConfig(regenerate_projections=True, distribution="gaussian")


def test_a_run_saved_with_stored_projections_resumes_regenerated_bit_identically(tmp_path):
    # Nothing about A is saved (it is re-derived from seeds), so the option may change on resume.
    def make(regenerate):
        model = tiny_qwen2().train()
        return model, LoGRAOptimizer(model, LoGRAConfig(rank=8, regenerate_projections=regenerate))

    def step(model, optimizer, index):
        optimizer.zero_grad()
        batch = tokens_4x10(index)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step(logra_inputs=LoGRAStepInputs(ProbeBatch.from_token_batch(batch)))

    straight, straight_optimizer = make(False)
    for index in range(3):
        step(straight, straight_optimizer, index)
    first, first_optimizer = make(False)
    step(first, first_optimizer, 0)
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, tmp_path / "state.pt")
    resumed, resumed_optimizer = make(True)
    saved = torch.load(tmp_path / "state.pt")
    resumed.load_state_dict(saved["model"])
    with pytest.warns(UserWarning, match="regenerate_projections: False -> True"):  # said, not refused
        resumed_optimizer.load_state_dict(saved["optimizer"])
    for index in (1, 2):
        step(resumed, resumed_optimizer, index)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), straight.state_dict().items()):
        assert torch.equal(a, b), name
