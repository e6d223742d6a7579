"""Two gloo processes: sketch reduction across ranks and the row-sharded (FSDP2) layout."""

import pytest
import torch

from lightning_logra import LoGRAConfig, LoGRAOptimizer
from tests.helpers.core import MLP_TARGETS, OddRowMlp, full
from tests.helpers.distributed import run_on_two_ranks

pytestmark = pytest.mark.distributed


def model_and_data():
    torch.manual_seed(0)
    model = OddRowMlp()
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(4, 8, generator=generator) for _ in range(2)]
    return model, steps


def loss_fn(model, x):
    return model(x).square().sum()


def run_steps(model, optimizer, steps, part=None, on_sketch=None):
    """Two optimizer steps; with ``part`` (rank, world) each rank takes its share of rows."""
    for x in steps:
        optimizer.zero_grad()
        if part is not None:
            rank, world = part
            x = x.chunk(world)[rank]
        loss_fn(model, x).backward()
        if on_sketch is not None:
            on_sketch(optimizer)
        optimizer.prepare_update(normalization_tokens=4)
        optimizer.apply_update(alpha=1.0)


def single_process_result(sketch_reduction="all_reduce"):
    model, steps = model_and_data()
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=16, target_modules=MLP_TARGETS, update_factor_dtype="float32"))
    first_sketches = []
    run_steps(model, optimizer, steps, on_sketch=lambda o: first_sketches.append(o.sketches.buffer.clone()))
    return [full(s.weight) for s in optimizer.sketches], first_sketches[0]


def _replicated_worker(rank, world):
    model, steps = model_and_data()
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=16, target_modules=MLP_TARGETS, update_factor_dtype="float32"))
    local = []

    def capture(o):
        if not local:
            local.append(o.sketches.buffer.clone())

    run_steps(model, optimizer, steps, part=(rank, world), on_sketch=capture)
    return {"weights": [full(s.weight) for s in optimizer.sketches], "local_sketch": local[0], "reduction": optimizer.layout.name}


def test_all_reduced_sketches_and_update_equal_the_single_process_batch():
    expected_weights, expected_sketch = single_process_result()
    results = run_on_two_ranks(_replicated_worker)
    # Each rank holds the sketch of its half of the batch; their sum is the full batch's sketch.
    torch.testing.assert_close(results[0]["local_sketch"] + results[1]["local_sketch"], expected_sketch, rtol=1e-5, atol=1e-6)
    for result in results:
        assert result["reduction"] == "all_reduce"
        # The mean over ranks is half the single-process sketch; RowAdam and the global
        # norm remove that constant factor, so the weights agree to float32 round-off.
        for weight, expected in zip(result["weights"], expected_weights):
            torch.testing.assert_close(weight, expected, rtol=1e-6, atol=1e-7)


def _sharded_worker(rank, world, sketch_reduction):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model, steps = model_and_data()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    config = LoGRAConfig(rank=16, target_modules=MLP_TARGETS, update_factor_dtype="float32", sketch_reduction=sketch_reduction)
    optimizer = LoGRAOptimizer(model, config)
    run_steps(model, optimizer, steps, part=(rank, world))
    moment = optimizer.state_dict()["second_moments"]["up_proj"]
    return {
        "weights": [full(s.weight) for s in optimizer.sketches],
        "reduction": optimizer.layout.name,
        "moment_rows": optimizer.sketches.states[0].second_moment.shape[0],
        "moment_is_dtensor": isinstance(moment, DTensor),
        "moment_full": full(moment),
    }


def test_reduce_scatter_gives_the_same_weights_as_all_reduce_under_fsdp2():
    replicated = run_on_two_ranks(_sharded_worker, "all_reduce")
    sharded = run_on_two_ranks(_sharded_worker, "auto")
    assert [r["reduction"] for r in replicated] == ["all_reduce"] * 2
    assert [r["reduction"] for r in sharded] == ["reduce_scatter"] * 2
    assert [r["moment_rows"] for r in sharded] == [151, 150]  # each rank keeps only its rows
    assert [r["moment_rows"] for r in replicated] == [301, 301]
    assert all(r["moment_is_dtensor"] for r in sharded)
    torch.testing.assert_close(sharded[0]["moment_full"], replicated[0]["moment_full"], rtol=1e-6, atol=0)
    for a, b in zip(sharded[0]["weights"], replicated[0]["weights"]):
        # Layer scalars are summed over two row blocks instead of one: float32 round-off.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    single, _ = single_process_result()
    for a, b in zip(sharded[1]["weights"], single):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
