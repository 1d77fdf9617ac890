"""Subcommands of the `tangram-jax` CLI (see tangram_jax/cli.py)."""
