"""A sparse mixture-of-experts MLP: top-k routing and the experts as grouped GEMMs.

Every token goes to `top_k` of `num_experts` expert MLPs and takes their outputs weighted by its
routing weights (`MoEConfig.routing`: Qwen3-MoE's softmax-then-top-k, GPT-OSS's top-k-then-
softmax). The experts run as two grouped GEMMs over the token copies sorted by expert: copy
(token t, choice j) goes to expert e = choice, the copies of expert e are one contiguous run of
rows, and `grouped_matmul` (XLA's `ragged_dot`; a gather of each row's expert for a few rows;
on Hopper JAX's Mosaic GPU kernel for many) multiplies run e by expert e's weights::

    x_sorted   [N * k, D]         rows sorted by expert (stable: token order within a run)
    gate_up    [E, D, 2 I]        gate columns then up columns (GPT-OSS's interleaved
                                  checkpoint layout is split at load time)
    down       [E, I, D]
    h = grouped_matmul(x_sorted, gate_up, sizes) -> act -> grouped_matmul(., down, sizes)

then each row is weighted, put back in token order and summed over the token's k rows.

Tensor parallelism shards the experts, not their matrices: device i of N holds experts
i E/N .. (i+1) E/N - 1 whole (`gate_up`, `down` and their biases sharded on the expert axis,
`engine.tensor_parallel.Placement`). Every device sees every token (the router is replicated),
runs the copies routed to its own experts (the others sort past its last group and are
selected away) and the partial outputs are summed over the devices (one psum of
[N, D], as the row-parallel down projection of a dense MLP). The mesh is a static attribute set
by `shard_experts`; without one the same function runs every expert on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from tangram_jax.models.config import MoEConfig

# The mesh axis experts are sharded on (`engine.tensor_parallel.AXIS`).
EXPERT_AXIS = "tp"


class SparseMoE(nnx.Module):
    """Router and experts of one layer; `__call__` maps x `[B, T, D]` to `[B, T, D]`."""

    def __init__(self, hidden_size: int, config: MoEConfig, dtype, rngs: nnx.Rngs):
        e, d, i = config.num_experts, hidden_size, config.intermediate_size
        self.config = config
        self.mesh = None   # set by `shard_experts` under tensor parallelism

        def normal(shape, fan_in):
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32)
                              * fan_in ** -0.5).astype(dtype))

        self.router = normal((d, e), d)
        self.router_bias = nnx.Param(jnp.zeros((e,), dtype)) if config.router_bias else None
        self.gate_up = normal((e, d, 2 * i), d)
        self.down = normal((e, i, d), i)
        if config.expert_bias:
            self.gate_up_bias = nnx.Param(jnp.zeros((e, 2 * i), dtype))
            self.down_bias = nnx.Param(jnp.zeros((e, d), dtype))
        else:
            self.gate_up_bias = self.down_bias = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x `[N, D]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int32)."""
        logits = jnp.dot(x, self.router[...])
        if self.router_bias is not None:
            logits = logits + self.router_bias[...]
        k = self.config.top_k
        if self.config.routing == "topk_softmax":
            top, experts = jax.lax.top_k(logits, k)
            return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top, experts = jax.lax.top_k(probs, k)
        if self.config.norm_topk_prob:
            top = top / top.sum(axis=-1, keepdims=True)
        return top.astype(x.dtype), experts.astype(jnp.int32)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        biases = (self.gate_up_bias[...], self.down_bias[...]) \
            if self.gate_up_bias is not None else ()
        run = functools.partial(expert_outputs, config=self.config, sharded=self.mesh is not None)
        if self.mesh is not None:
            expert = P(EXPERT_AXIS)
            run = jax.shard_map(run, mesh=self.mesh,
                                in_specs=(P(), P(), P(), expert, expert,
                                          (expert,) * len(biases)),
                                out_specs=P(), check_vma=False)
        return run(flat, weights, experts, self.gate_up[...], self.down[...], biases
                   ).reshape(shape)


def expert_outputs(x, weights, experts, gate_up, down, biases, *, config: MoEConfig,
                   sharded: bool):
    """Sum over each token's chosen experts of weight * expert(x), for the experts held here.

    x `[N, D]`; weights `[N, k]`; experts `[N, k]` int32 (global expert ids); gate_up
    `[E_here, D, 2 I]`, down `[E_here, I, D]`, biases () or (`[E_here, 2 I]`, `[E_here, D]`):
    this device's experts, the `E_here` from index `axis_index * E_here` (all of them when not
    `sharded`; sharded, the result is summed over the devices). Returns `[N, D]` in x's dtype.
    """
    n, k = experts.shape
    here = gate_up.shape[0]
    first = jax.lax.axis_index(EXPERT_AXIS) * here if sharded else 0
    local = (experts - first).reshape(-1)                        # [N k]
    mine = (local >= 0) & (local < here)
    key = jnp.where(mine, local, here)                           # others sort past the last run
    order = jnp.argsort(key, stable=True)
    token = order // k
    sorted_expert = jnp.minimum(key[order], here - 1)
    sizes = jnp.zeros((here + 1,), jnp.int32).at[key].add(1)[:here]
    h = grouped_matmul(x[token], gate_up, sizes)                 # [N k, 2 I]
    if biases:
        h = h + biases[0][sorted_expert]
    gate, up = jnp.split(h, 2, axis=-1)
    if config.activation == "clamped_swiglu":
        gate = jnp.minimum(gate, config.swiglu_limit)
        up = jnp.clip(up, -config.swiglu_limit, config.swiglu_limit)
        act = (up + 1) * (gate * jax.nn.sigmoid(gate * config.swiglu_alpha))
    else:
        act = jax.nn.silu(gate) * up
    y = grouped_matmul(act, down, sizes)                         # [N k, D]
    if biases:
        y = y + biases[1][sorted_expert]
    # Rows of other devices' experts are whatever the grouped GEMM left there: selected away.
    routed = weights.reshape(-1)[order].astype(y.dtype)[:, None]
    y = jnp.where(mine[order][:, None], y * routed, 0)
    # Back to token order (each token's k rows together) and summed: a gather and a reduction,
    # not a scatter-add, whose colliding rows the GPU serialises (13 of 90 ms of a 2048-token
    # Qwen3-30B-A3B prefill, `NOTES_engine.md`).
    unsorted = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    out = y[unsorted].reshape(n, k, -1).sum(axis=1, dtype=jnp.float32).astype(y.dtype)
    if sharded:
        out = jax.lax.psum(out, EXPERT_AXIS)
    return out.astype(x.dtype)


# Hopper tilings of JAX's Mosaic GPU grouped GEMM, measured at Qwen3-30B-A3B's expert shapes on
# an H200 (`benchmarks/moe_grouped_gemm.py`, `results/moe_grouped_gemm_gpu.json`): 26x XLA's
# ragged_dot at 16k rows (2048 tokens), 6.9x at 2048 rows, 2.6x at 512. XLA compiles the kernel
# once per call site, ~1.4 s each (`NOTES_engine.md`): 96 call sites make an 8B-class MoE step
# program ~2 min slower to compile. So only prefill-sized calls (MOSAIC_MIN_ROWS rows and up,
# few programs, where most of the gain is) use it; decode's many batch buckets keep ragged_dot.
MOSAIC_KINDS = ("H100", "H200", "H800", "H20", "GH200")
MOSAIC_MIN_ROWS = 2048
MOSAIC_BLOCK_K = 64
MOSAIC_LARGE_ROWS = 8192        # from here block_m 128 (0.47 ms at 16k rows), below it 64


def mosaic_tiling(rows: int, k: int, n: int, dtype, device_kind: str) -> dict | None:
    """The Mosaic GPU grouped GEMM's tiling for lhs `[rows, k]` x rhs `[G, k, n]` on a device of
    `device_kind`, or None where `jax.lax.ragged_dot` serves (not a Hopper GPU, few rows, a
    dtype or a width the kernel's tiles do not divide)."""
    if not any(kind in device_kind for kind in MOSAIC_KINDS) or rows < MOSAIC_MIN_ROWS:
        return None
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    block_n = next((b for b in (128, 64) if n % b == 0), None)
    if block_n is None or k % MOSAIC_BLOCK_K:
        return None
    return dict(block_m=128 if rows >= MOSAIC_LARGE_ROWS else 64, block_n=block_n,
                block_k=MOSAIC_BLOCK_K, max_concurrent_steps=4,
                grid_block_n=2 if n % (2 * block_n) == 0 else 1)


# Few rows (decode at a small batch) gather each row's expert matrix and multiply it: M x K x N
# weights read (and written once) instead of every group's. XLA's ragged_dot runs every group
# dense on a GPU: at Qwen3-30B-A3B's batch 1 on one H200 that read all 128 experts a layer,
# 13.3 ms of a 19.5 ms decode step (`results/families_qwen3_30b_a3b_tp1_gpu.json`). Gathering
# moves ~3 M x K x N bytes against G x K x N: from GATHER_GROUPS_PER_ROW groups a row.
GATHER_GROUPS_PER_ROW = 4


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """lhs `[M, K]` rows in runs of `sizes` `[G]`, rhs `[G, K, N]` -> `[M, N]`: run g times rhs[g].

    Rows past sum(sizes) are unspecified (XLA writes zeros, the Mosaic kernel and the gather
    leave other values): the caller selects them away. A few rows gather their groups' matrices
    (`GATHER_GROUPS_PER_ROW`); on a Hopper GPU many rows take JAX's Mosaic GPU kernel, which
    reads only the tiles of the experts that have rows; XLA's ragged_dot there runs every group
    dense.
    """
    rows, groups = lhs.shape[0], rhs.shape[0]
    if rows * GATHER_GROUPS_PER_ROW <= groups:
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right")
        return jnp.einsum("mk,mkn->mn", lhs, rhs[jnp.minimum(group, groups - 1)])
    tiling = None
    if jax.default_backend() == "gpu" and lhs.dtype == rhs.dtype:
        tiling = mosaic_tiling(rows, lhs.shape[1], rhs.shape[2], lhs.dtype,
                               jax.devices()[0].device_kind)
    if tiling is None:
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    padded = -(-rows // tiling["block_m"]) * tiling["block_m"]   # the row counts it was measured at
    lhs = jnp.pad(lhs, ((0, padded - rows), (0, 0)))
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, **tiling)[:rows]


def shard_experts(layers, mesh) -> None:
    """Run the MoE layers among `layers` expert-parallel over `mesh` (its `EXPERT_AXIS`); their
    expert weights must be placed sharded on the expert axis (`Placement.weights`)."""
    for layer in layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.mesh = mesh
