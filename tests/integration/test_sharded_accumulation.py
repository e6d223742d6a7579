"""Two gloo processes under FSDP2: sketches reduce-scattered in backward (sharded) against
the per-step reduction (local)."""

import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAOptimizer, LoGRAStepInputs, memory_report
from tests.helpers.core import MLP_TARGETS, OddRowMlp, full  # OddRowMlp.up_proj: 301 rows, 151 + 150 under FSDP2
from tests.helpers.distributed import run_on_two_ranks

pytestmark = pytest.mark.distributed
RANK = 16


def sharded_model(reshard_after_forward: bool = True) -> OddRowMlp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = OddRowMlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)), reshard_after_forward=reshard_after_forward)
    return model


def batches(rank: int, steps: int, micro_batches: int) -> list[list[torch.Tensor]]:
    """Each step's micro-batches of this rank (4 rows each)."""
    generator = torch.Generator().manual_seed(1 + rank)
    return [[torch.randn(4, 8, generator=generator) for _ in range(micro_batches)] for _ in range(steps)]


def optimizer_for(model, accumulation: str) -> LoGRAOptimizer:
    config = LoGRAConfig(rank=RANK, target_modules=MLP_TARGETS, update_factor_dtype="float32", sketch_accumulation=accumulation)
    return LoGRAOptimizer(model, config)


def train(model, optimizer, steps, on_backward=None) -> None:
    for micro_batches in steps:
        optimizer.zero_grad()
        for x in micro_batches:
            model(x).square().sum().backward()
        if on_backward is not None:
            on_backward(optimizer)
        optimizer.prepare_update(normalization_tokens=4 * len(micro_batches))
        optimizer.apply_update(alpha=1.0)


def local(tensor):
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def _training_worker(rank, world, accumulation, micro_batches):
    model = sharded_model()
    optimizer = optimizer_for(model, accumulation)
    reduced = []
    train(model, optimizer, batches(rank, 2, micro_batches),
          on_backward=lambda o: reduced.append(o.sketches.buffer.numel()))
    moments = optimizer.state_dict()["second_moments"]
    projection_dtype = optimizer.sketches.projections()[0][1].dtype
    predicted = memory_report(model, optimizer.config, world_size=world, compute_dtype=projection_dtype)
    return {"accumulation": optimizer.layout.accumulation, "buffer": reduced[0],
            "state_bytes": optimizer.state_bytes(), "predicted": predicted,
            "weights": [full(state.weight) for state in optimizer.sketches],
            "moments": [full(moments[name]) for name in MLP_TARGETS]}


# One micro-batch (the same bits as the per-step reduction) takes 50 s: slow; several stay in the default run.
@pytest.mark.parametrize("micro_batches", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_sharded_accumulation_equals_the_per_step_reduction(micro_batches):
    local = run_on_two_ranks(_training_worker, "local", micro_batches)
    sharded = run_on_two_ranks(_training_worker, "auto", micro_batches)
    assert [r["accumulation"] for r in local] == ["local"] * 2 and [r["accumulation"] for r in sharded] == ["sharded"] * 2
    # Every row on every rank, against the rank's own rows: up_proj 151 + 150, down_proj 4 + 4.
    assert [r["buffer"] for r in local] == [(301 + 8) * RANK] * 2
    assert [r["buffer"] for r in sharded] == [(151 + 4) * RANK, (150 + 4) * RANK]
    # What the optimizer holds, by part, is what memory_report predicts from shapes alone for
    # the largest shard (rank 0: FSDP2 gives the first ranks ceil(rows / world) rows); rank 1
    # owns one up_proj row fewer.
    for run in (local[0], sharded[0]):
        state, predicted = run["state_bytes"], run["predicted"]
        assert state["sketch_accumulator"] == run["buffer"] * 4 == predicted.sketch_accumulator_bytes
        assert state["accumulation_scratch"] == predicted.accumulation_scratch_bytes
        assert state["projections"] == predicted.projection_bytes
        assert state["second_moments"] == predicted.second_moment_bytes
        assert state["total"] == predicted.logra_state_bytes
    assert local[1]["state_bytes"]["second_moments"] == local[0]["state_bytes"]["second_moments"] - 4
    assert sharded[1]["state_bytes"]["total"] == sharded[0]["state_bytes"]["total"] - 4 - RANK * 4
    assert [r["state_bytes"]["accumulation_scratch"] > 0 for r in local + sharded] == [False, False, True, True]
    for a, b in zip(local, sharded):
        for expected, got in zip(a["weights"] + a["moments"], b["weights"] + b["moments"]):
            if micro_batches == 1:
                # The same contributions reduced by the same collective: the same bits.
                assert torch.equal(expected, got)
            else:
                # Per micro-batch the sum over ranks comes first, then the sum over
                # micro-batches: float32 round-off in the sketch, then in the update.
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def _resume_worker(rank, world):
    steps = batches(rank, 3, 2)
    model = sharded_model()
    optimizer = optimizer_for(model, "sharded")
    train(model, optimizer, steps[:2])
    saved = {key: local(value) for key, value in model.state_dict().items()}
    state = optimizer.state_dict()  # its moments are views of the live ones: copy them
    state["second_moments"] = {name: local(moment) for name, moment in state["second_moments"].items()}
    train(model, optimizer, steps[2:])
    straight = [full(s.weight) for s in optimizer.sketches]

    resumed_model = sharded_model()
    resumed = optimizer_for(resumed_model, "sharded")
    for key, value in resumed_model.state_dict().items():
        value.to_local().copy_(saved[key]) if hasattr(value, "to_local") else value.copy_(saved[key])
    resumed.load_state_dict(state)
    train(resumed_model, resumed, steps[2:])
    return [torch.equal(a, full(s.weight)) for a, s in zip(straight, resumed.sketches)]


def test_resume_under_sharded_accumulation_is_bit_identical():
    assert run_on_two_ranks(_resume_worker) == [[True, True], [True, True]]


def _nonfinite_worker(rank, world):
    model = sharded_model()
    optimizer = optimizer_for(model, "sharded")
    optimizer.config.kl_control = False
    before = [full(s.weight) for s in optimizer.sketches]
    if rank == 0:
        # Row 160 of up_proj belongs to rank 1: only rank 1's block of the reduced sketch
        # becomes NaN, and rank 0 must still skip with it.
        def poison(module, args, output):
            output.register_hook(lambda grad: grad.index_fill(-1, torch.tensor([160]), float("nan")))
        model.up_proj.register_forward_hook(poison)
    (x,) = batches(rank, 1, 1)[0]
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.sketches.accumulator.wait()  # the rows that reached this rank so far
    owned_finite = bool(torch.isfinite(optimizer.sketches.states[0].sketch).all())
    with pytest.warns(UserWarning, match="skipped a step"):
        report = optimizer.step(logra_inputs=LoGRAStepInputs(normalization_tokens=4))
    after = [full(s.weight) for s in optimizer.sketches]
    return {"owned_finite": owned_finite, "skipped": report.skipped, "updates": optimizer.update_count,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "zeroed": bool(optimizer.sketches.buffer.abs().sum() == 0)}


def test_a_nan_in_one_ranks_rows_skips_the_step_on_every_rank():
    results = run_on_two_ranks(_nonfinite_worker)
    # Rank 0's rows stay finite, rank 1's hold the NaN, before the step reads them.
    assert [r["owned_finite"] for r in results] == [True, False]
    for result in results:
        assert result["skipped"] and result["updates"] == 0 and result["unchanged"] and result["zeroed"]


def _uneven_worker(rank, world):
    # Parameters stay gathered after forward, so FSDP2 itself issues no collective for the
    # extra forward of rank 0 and the step is where the ranks meet again.
    model = sharded_model(reshard_after_forward=False)
    optimizer = optimizer_for(model, "sharded")
    optimizer.config.kl_control = False
    before = [full(s.weight) for s in optimizer.sketches]
    optimizer.zero_grad()
    micro_batches = batches(rank, 1, 2 if rank == 0 else 1)[0]
    sum(model(x).square().sum() for x in micro_batches).backward()
    with pytest.raises(RuntimeError, match="different numbers of backward passes") as error:
        optimizer.step(logra_inputs=LoGRAStepInputs(normalization_tokens=4))
    return {"message": str(error.value), "unchanged": all(torch.equal(a, full(s.weight)) for a, s in zip(before, optimizer.sketches))}


def test_uneven_micro_batch_counts_are_refused_on_every_rank():
    results = run_on_two_ranks(_uneven_worker)
    for result in results:
        assert "up_proj (1 to 2)" in result["message"] and "sketch_accumulation: local" in result["message"]
        assert result["unchanged"]
