import os

# Tests run on the CPU in float32; keep XLA from grabbing every core's worth of threads twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
