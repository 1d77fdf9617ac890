"""tangram-jax: a JAX/Pallas serving engine for non-uniform (head-wise) KV-cache compression."""

__version__ = "0.1.0"
