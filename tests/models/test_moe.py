"""The mixture-of-experts MLP's grouped GEMM: which kernel serves which shape, and rows of
other devices' experts never reach the output whatever the kernel leaves in them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tangram_jax.models import moe
from tangram_jax.models.config import MoEConfig

BF16 = jnp.bfloat16


@pytest.mark.parametrize("rows,k,n,dtype,kind,want", [
    (16384, 2048, 1536, BF16, "NVIDIA H200", dict(block_m=128, block_n=128, grid_block_n=2)),
    (2048, 2048, 1536, BF16, "NVIDIA H100 80GB HBM3", dict(block_m=64, block_n=128,
                                                           grid_block_n=2)),
    (2048, 2880, 2880, BF16, "NVIDIA H200", dict(block_m=64, block_n=64, grid_block_n=1)),
    (8, 2048, 1536, BF16, "NVIDIA H200", None),            # decode at batch 1: XLA is faster
    (512, 2048, 1536, BF16, "NVIDIA H200", None),          # decode at batch 64: compiles faster
    (2048, 2048, 1536, jnp.float32, "NVIDIA H200", None),
    (2048, 100, 1536, BF16, "NVIDIA H200", None),           # K not a multiple of block_k
    (2048, 2048, 1000, BF16, "NVIDIA H200", None),
    (2048, 2048, 1536, BF16, "NVIDIA A100-SXM4-80GB", None),
    (2048, 2048, 1536, BF16, "cpu", None),
])
def test_the_mosaic_kernel_serves_hopper_shapes_its_tiles_divide(rows, k, n, dtype, kind, want):
    tiling = moe.mosaic_tiling(rows, k, n, dtype, kind)
    if want is None:
        assert tiling is None
    else:
        assert {key: tiling[key] for key in want} == want
        assert tiling["block_k"] == moe.MOSAIC_BLOCK_K and k % tiling["block_k"] == 0


def test_grouped_matmul_off_hopper_is_xla_ragged_dot():
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(10, 8)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(3, 8, 5)), jnp.float32)
    sizes = jnp.array([4, 0, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(moe.grouped_matmul(lhs, rhs, sizes)),
                                  np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)))


@pytest.mark.parametrize("rows,groups", [(1, 8), (2, 8), (5, 24), (32, 128)])
def test_few_rows_gather_their_groups_matrices_as_ragged_dot_multiplies(rows, groups):
    """Decode-sized calls (`GATHER_GROUPS_PER_ROW` groups a row or more) gather each row's
    matrix: the rows in groups equal ragged_dot's; empty groups and rows past the last group
    (other devices' experts) are allowed."""
    assert rows * moe.GATHER_GROUPS_PER_ROW <= groups
    rng = np.random.default_rng(rows)
    lhs = jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(groups, 16, 12)), jnp.float32)
    counts = np.zeros(groups, np.int32)
    np.add.at(counts, rng.integers(0, groups, size=max(rows - 1, 1)), 1)   # one row past: others'
    sizes = jnp.asarray(counts)
    got = np.asarray(moe.grouped_matmul(lhs, rhs, sizes))
    want = np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes))
    valid = int(counts.sum())
    np.testing.assert_allclose(got[:valid], want[:valid], rtol=1e-5, atol=1e-5)


def test_rows_of_other_devices_experts_are_selected_away(monkeypatch):
    """A device holding experts 0-1 of 4 (what `shard_experts` gives device 0 of 2): copies
    routed to experts 2-3 sort past its last group, where the kernel's output is garbage (NaN
    here, as the Mosaic kernel can leave); the output is that of its own experts alone."""
    real = moe.grouped_matmul

    def leaves_garbage(lhs, rhs, sizes):
        out = real(lhs, rhs, sizes)
        return jnp.where(jnp.arange(lhs.shape[0])[:, None] < sizes.sum(), out, jnp.nan)

    rng = np.random.default_rng(1)
    n, d, i, top_k = 6, 8, 4, 2
    config = MoEConfig(num_experts=4, top_k=top_k, intermediate_size=i)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=(n, top_k)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(4)[:top_k] for _ in range(n)]), jnp.int32)
    gate_up = jnp.asarray(rng.normal(size=(2, d, 2 * i)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(2, i, d)), jnp.float32)
    want = np.zeros((n, d))
    for t in range(n):
        for j in range(top_k):
            e = int(experts[t, j])
            if e < 2:
                gate, up = np.split(np.asarray(x[t]) @ np.asarray(gate_up[e]), 2)
                act = gate / (1 + np.exp(-gate)) * up
                want[t] += float(weights[t, j]) * (act @ np.asarray(down[e]))
    monkeypatch.setattr(moe, "grouped_matmul", leaves_garbage)
    got = moe.expert_outputs(x, weights, experts, gate_up, down, (), config=config,
                             sharded=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
