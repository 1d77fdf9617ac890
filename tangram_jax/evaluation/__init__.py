"""Accuracy evaluation: generated multi-turn tasks, scoring, and the harness that serves them
in every mode (`tangram-jax bench accuracy`)."""
