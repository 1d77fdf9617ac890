"""Pallas kernels (each with its pure-jnp reference beside it)."""
