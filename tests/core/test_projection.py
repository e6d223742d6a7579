import hashlib
import math

import pytest
import torch

from lightning_logra import make_projection, projection_seed
from lightning_logra.core.projection import (
    canonical_name,
    projection_is_exact,
    projection_storage_dtype,
)


def test_seed_follows_the_spec_formula():
    name = "model.layers.3.self_attn.q_proj"
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    expected = (42 * 1_000_003 + 5 * 7_919 + digest) & (2**62 - 1)
    assert projection_seed(42, 5, name) == expected


def test_wrapper_components_do_not_change_the_seed():
    plain = "model.layers.0.mlp.up_proj"
    wrapped = "_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp._fsdp_wrapped_module.up_proj"
    assert canonical_name(wrapped) == plain
    assert projection_seed(42, 0, wrapped) == projection_seed(42, 0, plain)


def test_seed_changes_with_update_layer_and_base_seed():
    seeds = {projection_seed(s, u, n) for s in (1, 2) for u in (0, 1) for n in ("a.q_proj", "a.k_proj")}
    assert len(seeds) == 8


def test_rademacher_entries_are_plus_minus_one_over_sqrt_rank():
    a = make_projection(16, 300, seed=7)
    assert a.shape == (16, 300) and a.dtype == torch.float32
    assert set(a.unique().tolist()) == {-0.25, 0.25}
    # Each column of A has squared norm exactly 1, so diag(A^T A) = 1.
    assert torch.equal(a.pow(2).sum(0), torch.ones(300))


def test_rademacher_draw_uses_uint8_randint_on_a_cpu_generator():
    generator = torch.Generator().manual_seed(123)
    bits = torch.randint(0, 2, (4, 9), generator=generator, dtype=torch.uint8)
    assert torch.equal(make_projection(4, 9, seed=123), (bits.float() * 2 - 1) / 2)


def test_gaussian_draw_uses_float64_randn_then_casts():
    generator = torch.Generator().manual_seed(5)
    expected = (torch.randn(8, 10, generator=generator, dtype=torch.float64) / math.sqrt(8)).float()
    assert torch.equal(make_projection(8, 10, seed=5, distribution="gaussian"), expected)


def test_same_inputs_give_bit_identical_matrices():
    for distribution in ("rademacher", "gaussian"):
        first = make_projection(32, 64, seed=99, distribution=distribution)
        assert torch.equal(first, make_projection(32, 64, seed=99, distribution=distribution))
        assert not torch.equal(first, make_projection(32, 64, seed=100, distribution=distribution))


def test_unknown_distribution_is_an_error():
    with pytest.raises(ValueError, match="distribution"):
        make_projection(4, 4, seed=0, distribution="sparse")


def test_bfloat16_storage_is_exact_when_sqrt_rank_is_a_power_of_two():
    assert projection_is_exact(256, "rademacher", torch.bfloat16)
    assert not projection_is_exact(128, "rademacher", torch.bfloat16)
    assert not projection_is_exact(256, "gaussian", torch.bfloat16)
    assert projection_storage_dtype(256, "rademacher", torch.bfloat16) == torch.bfloat16
    assert projection_storage_dtype(128, "rademacher", torch.bfloat16) == torch.float32
    exact = make_projection(256, 512, seed=3, dtype=torch.bfloat16)
    assert torch.equal(exact.float(), make_projection(256, 512, seed=3))


@pytest.mark.parametrize("rank", [1, 3, 4, 16, 48, 64, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_direct_rademacher_draw_has_the_float64_routes_bits(rank, dtype):
    # Where the entries are exact in the dtype, A is computed in it directly; it must be the
    # float64 draw rounded to the dtype, bit for bit (non-exact bf16/fp16 ranks keep that route).
    bits = torch.randint(0, 2, (rank, 70), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    reference = bits.to(torch.float64).mul_(2.0).sub_(1.0).mul_(1.0 / math.sqrt(rank)).to(dtype)
    assert torch.equal(make_projection(rank, 70, seed=9, dtype=dtype), reference)
