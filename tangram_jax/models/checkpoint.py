"""Cache of converted model parameters (orbax), so a model's second load skips conversion.

A GGUF load dequantizes every tensor and builds the tokenizer from the file's metadata; a HF
folder load transposes and casts every tensor. The result depends only on the source and the target
dtype. One cache entry per (source's resolved path, size and mtime of the file or of each file in
the folder the load reads, dtype) lives under `cache_root()/<key>/`:

    manifest.json   what the entry was made from + the HF config dict + tokenizer facts
    tokenizer.json  the built `tokenizers.Tokenizer`
    params/         orbax checkpoint: {"path/of/param": array} of the Decoder's parameters

An entry is written in a temporary folder and renamed into place, so one without a manifest
was damaged by hand or by an older version. The manifest records the SHA-256 of every other file
of the entry and of its own content, checked before anything is restored: orbax reads a damaged
data file without complaint more often than not (flipped bytes become NaN weights) and, when it
does notice, logs thousands of lines. A restore that fails (a file missing, damaged or added to
the checksummed set, shapes that do not match the config) is reported as `CacheCorrupt`; the
caller then deletes the entry and converts again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

# 2: float32 metadata read back as shortest decimals; 3: HF folders, special tokens; 4: per-layer
# constants (RoPE, window) in the parameters, MoE and Gemma-3 families, and file checksums
FORMAT_VERSION = 5

# What a HF-folder load reads besides the weights (their changes invalidate an entry too).
_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "model.safetensors.index.json")
_MANIFEST = "manifest.json"
_SELF_DIGEST = "manifest_sha256"   # the manifest's checksum of its own content


class CacheCorrupt(RuntimeError):
    """A cache entry exists but cannot be restored."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $TANGRAM_JAX_CACHE, else ~/.cache/tangram_jax."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("TANGRAM_JAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tangram_jax"


def source_fingerprint(source: Path, dtype) -> dict:
    """The facts a cache entry is valid for."""
    source = Path(source).resolve()
    if source.is_dir():
        files = sorted({p for name in _FOLDER_FILES if (p := source / name).is_file()}
                       | set(source.glob("*.safetensors")))
        stats = [(p.name, p.stat()) for p in files]
        size = sum(st.st_size for _, st in stats)
        mtime = {name: st.st_mtime_ns for name, st in stats}
    else:
        st = source.stat()
        size, mtime = st.st_size, st.st_mtime_ns
    return {"format_version": FORMAT_VERSION, "source": str(source), "size": size,
            "mtime_ns": mtime, "dtype": jnp.dtype(dtype).name}


def entry_dir(root: Path, fingerprint: dict) -> Path:
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:24]
    return root / f"{Path(fingerprint['source']).stem}-{fingerprint['dtype']}-{key}"


def _flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    return {"/".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(nnx.state(model))}


def save_entry(entry: Path, fingerprint: dict, model: nnx.Module, hf_config: dict,
               tokenizer_json: str, tokenizer_meta: dict) -> None:
    """Writes a complete entry at `entry`.

    Built in a private temporary folder and renamed into place, so a concurrent load of the same
    model never sees (or deletes) a half-written entry; if another process got there first, its
    entry is kept.
    """
    import orbax.checkpoint as ocp

    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save((tmp / "params").absolute(), _flat_params(model))
            ckpt.wait_until_finished()
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        manifest = {"fingerprint": fingerprint, "hf_config": hf_config, "tokenizer": tokenizer_meta,
                    "files": file_digests(tmp)}
        manifest[_SELF_DIGEST] = _manifest_digest(manifest)
        (tmp / _MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
        if entry.exists() and not (entry / _MANIFEST).is_file():
            shutil.rmtree(entry, ignore_errors=True)  # an interrupted or damaged entry
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / _MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune_stale(root: Path, fingerprint: dict) -> list[Path]:
    """Deletes entries made from an older state of the same source with the same dtype (the file
    changed, or the cache format did); returns what was removed."""
    removed = []
    for entry in root.glob("*/" + _MANIFEST):
        if ".tmp-" in entry.parent.name:
            continue  # another process's entry being written
        try:
            old = json.loads(entry.read_text(encoding="utf-8"))["fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if old != fingerprint and old.get("source") == fingerprint["source"] \
                and old.get("dtype") == fingerprint["dtype"]:
            shutil.rmtree(entry.parent, ignore_errors=True)
            removed.append(entry.parent)
    return removed


def read_manifest(entry: Path, fingerprint: dict) -> dict | None:
    """The entry's manifest, or None when there is no entry for `fingerprint`.
    Raises CacheCorrupt when it is missing from an entry's folder, unreadable, its content differs from its recorded checksum,
    or it was made for another source or dtype."""
    path = entry / _MANIFEST
    if not path.is_file():
        # Entries are written aside and renamed into place whole: files without a manifest
        # are a damaged entry, not a missing one.
        if entry.is_dir() and any(entry.iterdir()):
            raise CacheCorrupt(f"{path} is missing")
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:   # UnicodeDecodeError is a ValueError
        raise CacheCorrupt(f"{path}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get(_SELF_DIGEST) != _manifest_digest(manifest):
        raise CacheCorrupt(f"{path}: damaged (its content differs from its recorded checksum)")
    if manifest.get("fingerprint") != fingerprint:
        raise CacheCorrupt(f"{path}: made from a different source or dtype")
    return manifest


def verify_files(entry: Path, manifest: dict) -> None:
    """Raise CacheCorrupt unless the entry's files are exactly those the manifest lists, each
    with its recorded SHA-256 (the first difference is named)."""
    recorded = manifest.get("files")
    if not isinstance(recorded, dict) or not recorded:
        raise CacheCorrupt(f"{entry}: the manifest lists no file checksums")
    found = file_digests(entry)
    for name in sorted(set(recorded) | set(found)):
        if name not in found:
            raise CacheCorrupt(f"{entry}: {name} is missing")
        if name not in recorded:
            raise CacheCorrupt(f"{entry}: {name} was not part of the entry when it was written")
        if found[name] != recorded[name]:
            raise CacheCorrupt(f"{entry}: {name} is damaged (its SHA-256 differs from the one "
                               f"recorded when the entry was written)")


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under `folder` but the manifest, by path relative to it."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name != _MANIFEST:
            with open(path, "rb") as f:
                digests[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def _manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's content without its own checksum (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != _SELF_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def restore_params(entry: Path, abstract_model: nnx.Module) -> nnx.Module:
    """Fills `abstract_model` (from `nnx.eval_shape`) with the entry's parameters."""
    import orbax.checkpoint as ocp

    graphdef, abstract_state = nnx.split(abstract_model)
    flat = nnx.to_flat_state(abstract_state)
    target = {"/".join(map(str, path)): jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype)
              for path, var in flat}
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore((entry / "params").absolute(), target)
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        raise CacheCorrupt(f"{entry}: cannot restore parameters ({type(e).__name__}: {e})") from e
    for name, spec in target.items():
        value = restored.get(name)
        if value is None or value.shape != spec.shape or value.dtype != spec.dtype:
            raise CacheCorrupt(f"{entry}: parameter {name} missing or of the wrong shape/dtype")
    for path, var in flat:
        var.set_value(restored["/".join(map(str, path))])
    return nnx.merge(graphdef, abstract_state)
