"""`tangram-jax serve`: an OpenAI-compatible HTTP server over one engine (see `app.py`).

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client): `pip install -e .[serve]`.
"""

from tangram_jax.server.app import build_app

__all__ = ["build_app"]
