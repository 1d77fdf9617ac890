"""The one place that decides how the Pallas kernels are lowered and whether they are interpreted.

Lowering: every kernel of this package is written for Pallas's **Triton** lowering (the path that
is implemented and measured; it runs on A100 and Hopper). JAX >= 0.11 deprecates that lowering in
favour of Mosaic GPU (Hopper only); a Mosaic GPU port would change `LOWERING` and
`compiler_params` here, and the kernels' bodies (Mosaic GPU has no masked gather loads). Passing a
Triton `CompilerParams` is what selects the Triton lowering in `pallas_call` on both jax 0.10.x and
0.11.x (the class is `jax.experimental.pallas.triton.CompilerParams` in both).

Interpretation: on a CPU backend Pallas can only interpret (`interpret=True`); on a GPU the kernels
compile. `resolve_interpret(None)` picks by the default backend, so callers pass `interpret=None`.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOWERING = "triton"

# The kernels' softmax runs in base 2 (`exp2`): logits are scaled by log2(e), and a base-2
# log-sum-exp m + log2(l) becomes natural by a factor ln 2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# jax >= 0.11 warns on every Triton lowering (a DeprecationWarning per compile); the choice is
# deliberate and recorded above, so the warning is silenced for this message only.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


def default_interpret() -> bool:
    """True when the default JAX backend cannot compile Pallas-Triton kernels (CPU)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def resolve_interpret(interpret: bool | None) -> bool:
    """`interpret` if given, else `default_interpret()`."""
    if interpret is None:
        return default_interpret()
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool or None, got {type(interpret).__name__}")
    return interpret


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler parameters (selects the Triton lowering; ignored when interpreting)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dot_f32(a, b, trans_b: bool = False):
    """Matrix-unit product with float32 accumulation; float32 operands stay IEEE (no tf32), so
    f32 kernels match their references to ~1e-6 and bf16 ones to bf16 rounding."""
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=False).astype("float32")


def exp2(x, *, fast: bool):
    """2 ** x in float32 inside a kernel. `fast` (compiled kernels: inline PTX cannot be
    interpreted): one ``ex2.approx.ftz`` (the GPU's special-function unit, ~2 ulp, subnormal
    results flushed to 0: softmax weights below 2^-126 of the row's largest), where Pallas
    lowers `jnp.exp2` / `jnp.exp` to libdevice's full-range functions, several instructions
    an element around the same unit; else `jnp.exp2`."""
    if not fast:
        return jnp.exp2(x)
    return plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]
