"""Where a runner's arrays live: one device, or a tensor-parallel mesh of several.

Tensor parallelism splits every KV head group across the devices (Megatron-style for the
projections and the MLP, attention per device):

    KV pool      [num_pages, G, page_size, d]   axis G sharded: device i holds heads
                                                 i*G/N .. (i+1)*G/N - 1 of *every* group
    block table  [slots, layers, groups, pages] replicated: the same page ids on every device
    q/k/v_proj, gate/up_proj   column-parallel (output features sharded)
    o_proj, down_proj          row-parallel (input features sharded; XLA adds the all-reduce)
    experts (MoE)              sharded by expert: device i holds experts i*E/N .. whole
                               (`models.moe`: each device runs its experts' tokens, a psum)
    embeddings, norms, head, router   replicated

Splitting inside groups (not whole groups per device) keeps the host side single and exact:
one page manager, one block table, one reservation, and every device holds 1/N of every
group's pages, so the devices' attention work and memory are equal whatever the budgets (the
balance is exact, not approximate). It needs G divisible by N: `full` and `dynamic` layouts
have G = num_kv_heads; a `tangram` profile must be calibrated with a group size that N divides.

Head order: the weights are permuted so the global head axis is device-major ([device][group]
[head of the group on that device]); each device's contiguous slice is then an ordinary
group-major layout with G/N heads per group, and the attention code, kernels and split maps run
unchanged on it under `shard_map`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

AXIS = "tp"

# Weights sharded by name (the last two path entries, e.g. "q_proj", "kernel"):
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output features sharded
_ROW = ("o_proj", "down_proj")                                     # input features sharded
_EXPERTS = ("gate_up", "down", "gate_up_bias", "down_bias")        # of "moe": the expert axis


def check_tensor_parallel(tp: int, *, num_heads: int, num_kv_heads: int, group_size: int,
                          intermediate_size: int, num_experts: int | None = None,
                          what: str = "tensor_parallel_size") -> None:
    """One clear error when `tp` devices cannot split this model and layout (a mixture of
    experts: its experts, not its dense intermediate size)."""
    if tp == 1:
        return
    sizes = [("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
             ("the layout's group size", group_size)]
    sizes.append(("num_experts", num_experts) if num_experts
                 else ("intermediate_size", intermediate_size))
    problems = [f"{name} {value}" for name, value in sizes if value % tp]
    if problems:
        raise ValueError(f"{what} {tp} must divide the model's and the layout's head counts; "
                         f"it does not divide {', '.join(problems)} (tangram profiles: "
                         f"calibrate with a group size that {tp} divides)")


def device_major_perm(head_perm: np.ndarray, group_size: int, tp: int) -> np.ndarray:
    """The layout's per-layer KV head order ([layers, num_kv_heads], group-major) reordered
    device-major: position (i, g, j) holds group g's head i * G/N + j."""
    head_perm = np.asarray(head_perm)
    if tp == 1:
        return head_perm
    groups = head_perm.shape[1] // group_size
    local = group_size // tp
    order = [g * group_size + i * local + j
             for i in range(tp) for g in range(groups) for j in range(local)]
    return head_perm[:, order]


def devices_for(tensor_parallel_size: int, replica: int = 0) -> list[jax.Device]:
    """The devices of one engine: replica r of `data_parallel_size` takes the r-th run of
    `tensor_parallel_size` devices of this process (`jax.local_devices()`: with JAX's
    distributed runtime up, each process builds its engines on its own devices, so tensor
    parallelism never spans hosts). One clear error when there are too few."""
    devices = jax.local_devices()
    need = (replica + 1) * tensor_parallel_size
    if len(devices) < need:
        where = f"{jax.default_backend()} has {len(devices)}"
        if jax.process_count() > 1:
            where = (f"process {jax.process_index()} of {jax.process_count()} has "
                     f"{len(devices)} local {jax.default_backend()} devices (tensor parallelism "
                     f"across hosts is not supported: tensor_parallel_size must fit one process's "
                     f"devices)")
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} x {replica + 1} replica(s) needs "
            f"{need} devices, {where} (on a CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} gives {need})")
    return devices[replica * tensor_parallel_size:need]


class Placement:
    """The devices of one runner and how each of its arrays is laid out over them."""

    def __init__(self, devices: Sequence[jax.Device]):
        self.devices = list(devices)
        self.tp = len(self.devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,)) if self.tp > 1 else None

    def _sharding(self, spec: P):
        if self.mesh is None:
            return SingleDeviceSharding(self.devices[0])
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self):
        """Block tables, slot tokens, anything every device reads whole."""
        return self._sharding(P())

    @property
    def pool(self):
        """`k_pages` / `v_pages` [num_pages, G, page_size, d] (and a quantised pool's scale
        arrays [num_pages, G, page_size]): the G axis over the devices."""
        return self._sharding(P(None, AXIS))

    def weights(self, state, stacked: bool = False):
        """`state` (an nnx State, or a list of them) placed: column / row parallel by name,
        experts by expert, the rest replicated. stacked: the layer states carry a leading layer
        axis (scan). `jax.ShapeDtypeStruct` leaves (an abstract model) get the same shardings."""
        def place(path, x):
            sharding = self.weight_sharding(path, np.ndim(x), stacked)
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return jax.device_put(x, sharding)
        return jax.tree_util.tree_map_with_path(place, state)

    def weight_sharding(self, path, ndim: int, stacked: bool = False):
        """The sharding of the weight at tree `path` (nnx state keys) with `ndim` axes (see
        `weights`): what a caller building weights in place (random benchmark models) uses."""
        lead = (None,) if stacked else ()
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        owner = next((n for n in reversed(names) if n in _COLUMN + _ROW), None)
        ndim = ndim - len(lead)
        spec = (None,) * ndim
        if "moe" in names and any(n in _EXPERTS for n in names[names.index("moe"):]):
            spec = (AXIS,) + (None,) * (ndim - 1)        # [experts, ...]
        elif owner in _COLUMN:
            spec = (None,) * (ndim - 1) + (AXIS,)        # kernel [in, out] or bias [out]
        elif owner in _ROW and ndim == 2:
            spec = (AXIS, None)                           # kernel [in, out]; bias replicated
        return self._sharding(P(*lead, *spec))

    def per_device(self, fn: Callable, in_specs, out_specs) -> Callable:
        """`fn` run on each device's slice (`shard_map` over the mesh), or `fn` itself on one
        device. Specs name the sharded axis with `AXIS`."""
        if self.mesh is None:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
