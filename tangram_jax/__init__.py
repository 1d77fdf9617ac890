"""tangram-jax: a JAX/Pallas serving engine for non-uniform (head-wise) KV-cache compression.

    from tangram_jax import LLM, SamplingParams
"""

from tangram_jax.host_memory import let_pinned_pool_reach_host_memory
from tangram_jax.version import __version__

# Before any JAX backend starts: the host KV tier's budget may exceed XLA's default cap on
# page-locked host memory (64 GiB a GPU).
let_pinned_pool_reach_host_memory()

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput"]


def __getattr__(name):
    # Lazy: `import tangram_jax` (and the CLI's --help) must not pay for importing JAX.
    if name == "LLM":
        from tangram_jax.llm import LLM
        return LLM
    if name == "SamplingParams":
        from tangram_jax.sampling import SamplingParams
        return SamplingParams
    if name in ("Engine",):
        from tangram_jax.engine.llm_engine import Engine
        return Engine
    if name == "EngineConfig":
        from tangram_jax.engine.config import EngineConfig
        return EngineConfig
    if name == "RequestOutput":
        from tangram_jax.engine.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'tangram_jax' has no attribute {name!r}")
