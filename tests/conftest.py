import os

# Tests run on the CPU in float32; keep XLA from grabbing every core's worth of threads twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU compiles at LLVM -O0 without its expensive passes: the suite is mostly compiles of
# programs that then run a few tiny steps (one warm-up test 70 -> 43 s; the suite on 2 cores
# 34:47 -> 25:54 in a fresh clone). Subprocesses take these flags over
# (`tiny_engine.child_xla_flags`).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
# No persistent compile cache (`engine/compile_cache.py`): once, reading an XLA:CPU executable
# of the server tests' penalty decode step from it aborted the whole test process (a fresh CI
# machine gains nothing from the cache anyway). Subprocesses inherit it.
os.environ.setdefault("TANGRAM_JAX_COMPILE_CACHE", "off")
# The converted-model cache and GGUF summaries (`models/checkpoint.py`) in a folder of this
# run, removed at its end: each test's tiny model is a new cache entry, which would otherwise
# pile up in the user's ~/.cache/tangram_jax (957 entries on one machine). Subprocesses inherit
# it.
if "TANGRAM_JAX_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TANGRAM_JAX_CACHE"] = tempfile.mkdtemp(prefix="tangram-jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TANGRAM_JAX_CACHE"], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A Hugging Face folder of the tiny random-weight Llama (`tiny_engine.build_tiny_model`),
    built once per test module that asks for it."""
    from tiny_engine import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each module's engines and compiled programs are freed when it ends. The whole suite runs
    in one process; late in it (~90%), compiling the server tests' penalty decode step on the
    engine's thread crashed XLA:CPU (abort, segfault) in a test that passes alone, while every
    earlier module's executables were still cached. Cause unknown; with this the suite passes."""
    yield
    import gc
    gc.collect()
    jax.clear_caches()
