"""JAX's persistent compilation cache, on by default for the engine.

Compiling the engine's steps (every decode bucket, prefill row count and sampling shape) takes
most of a start-up; with the cache a second start of the same configuration loads the compiled
executables from disk instead. Where it lives:

- `EngineConfig.compile_cache_dir` if given (``""`` or ``"off"`` turns the cache off);
- else the environment variable ``TANGRAM_JAX_COMPILE_CACHE`` (a folder, or ``off``);
- else ``~/.cache/tangram_jax/jax``.

A cache folder the user already gave JAX (``jax_compilation_cache_dir`` /
``JAX_COMPILATION_CACHE_DIR``) wins over all of these. JAX only caches compilations that took
at least ``jax_persistent_cache_min_compile_time_secs`` (1 s by default); the engine sets it to
0 so that its many small steps are cached too. Entries are keyed by the program, the compile
options, the jax/jaxlib version and the device, so a changed configuration compiles afresh.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger(__name__)

CACHE_ENV = "TANGRAM_JAX_COMPILE_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/tangram_jax/jax")
_OFF = ("", "off", "0", "false", "none", "no")


def resolve_cache_dir(configured: str | os.PathLike | None) -> Path | None:
    """The folder the engine would use: `configured`, else ``$TANGRAM_JAX_COMPILE_CACHE``, else
    the default; None when turned off."""
    value = configured if configured is not None else os.environ.get(CACHE_ENV)
    if value is None:
        return DEFAULT_CACHE_DIR.expanduser()
    if str(value).strip().lower() in _OFF:
        return None
    return Path(value).expanduser()


def enable_compile_cache(configured: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at the engine's folder (see the module
    docstring) and return the folder in use, or None when the cache is off."""
    current = jax.config.jax_compilation_cache_dir
    folder = resolve_cache_dir(configured)
    if current:                      # the user (or an earlier engine) chose already
        if folder is not None and Path(current) != folder and configured is not None:
            log.warning("compile cache: JAX already caches in %s; compile_cache_dir=%s is "
                        "ignored (JAX initialises its cache once per process)", current, folder)
        return Path(current)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compile cache: cannot create %s (%s); compiling without a cache", folder, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder
