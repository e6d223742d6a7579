import math

import pytest
import torch

from lightning_logra import row_adam_direction
from lightning_logra.core.row_adam import row_adam_directions


def reference_step(sketch, v, t, beta2=0.95, eps=1e-8):
    """The spec's section 5, written out one line per formula in float64."""
    s = sketch.double()
    v = beta2 * v + (1 - beta2) * (s**2).mean(dim=1, keepdim=True)
    rho = torch.sqrt(v / (1 - beta2**t))
    den = rho + max(eps * rho.mean().item(), torch.finfo(torch.float32).tiny)
    scale = den.min() / den
    scale = scale / torch.sqrt((scale**2).mean())
    d = scale * s
    d = d * s.norm() / d.norm()
    return d, v


def test_matches_an_independent_step_by_step_computation_over_several_steps():
    generator = torch.Generator().manual_seed(0)
    rows_scale = torch.logspace(-3, 1, 9).unsqueeze(1)  # rows of very different size
    moment = torch.zeros(9, 1)
    reference_moment = torch.zeros(9, 1, dtype=torch.float64)
    for step in range(1, 6):
        sketch = torch.randn(9, 6, generator=generator) * rows_scale
        direction = row_adam_direction(sketch, moment, step=step)
        expected, reference_moment = reference_step(sketch, reference_moment, step)
        # float32 arithmetic against a float64 reference
        torch.testing.assert_close(direction.double(), expected, rtol=2e-6, atol=1e-9)
        torch.testing.assert_close(moment.double(), reference_moment, rtol=2e-6, atol=0)


def test_direction_keeps_the_sketch_norm_and_equalises_rows():
    sketch = torch.tensor([[100.0, -100.0], [1.0, 1.0], [0.01, 0.03]])
    direction = row_adam_direction(sketch, torch.zeros(3, 1), step=1)
    assert math.isclose(direction.norm().item(), sketch.norm().item(), rel_tol=1e-6)
    row_norms = direction.norm(dim=1)
    # One step from zero moments: every row is divided by its own RMS, so rows end up equal
    # up to the relative epsilon, eps * mean(rho) / rho_min = 1e-8 * 34 / 0.02 ~ 2e-5.
    torch.testing.assert_close(row_norms, row_norms[0].expand(3), rtol=5e-5, atol=0)


def test_zero_sketch_gives_zero_direction():
    moment = torch.zeros(4, 1)
    direction = row_adam_direction(torch.zeros(4, 3), moment, step=1)
    assert torch.equal(direction, torch.zeros(4, 3)) and torch.equal(moment, torch.zeros(4, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_sketch_raises_and_leaves_the_moment_untouched(bad):
    moment = torch.full((3, 1), 0.5)
    sketch = torch.ones(3, 2)
    sketch[1, 0] = bad
    with pytest.raises(FloatingPointError, match="layers.1.q_proj"):
        row_adam_directions([torch.ones(2, 2), sketch], [torch.zeros(2, 1), moment], step=1, beta2=0.95,
                            epsilon=1e-8, names=["layers.0.q_proj", "layers.1.q_proj"])
    assert torch.equal(moment, torch.full((3, 1), 0.5))


def test_many_layers_at_once_equal_one_at_a_time():
    generator = torch.Generator().manual_seed(3)
    sketches = [torch.randn(5, 4, generator=generator), torch.randn(7, 4, generator=generator)]
    together = row_adam_directions(sketches, [torch.zeros(5, 1), torch.zeros(7, 1)], step=1, beta2=0.95, epsilon=1e-8)
    for sketch, direction in zip(sketches, together):
        assert torch.equal(direction, row_adam_direction(sketch, torch.zeros(sketch.shape[0], 1), step=1))
