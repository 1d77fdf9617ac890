"""Loads a Hugging Face model folder (config.json + *.safetensors) into a `Decoder`.

`decoder_from_state_dict` is the one place that maps HF parameter names onto the decoder; the GGUF
loader produces an HF-named state dict and goes through it too.

safetensors files are read by a small reader here rather than by the `safetensors` package because
numpy has no bfloat16 (`safetensors.numpy` refuses bf16 checkpoints); `ml_dtypes`, which JAX
already depends on, provides it. The reader checks every offset against the file size, so a
truncated or corrupt file is reported by name instead of failing somewhere inside numpy.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}

# Checkpoint entries that carry no weights the decoder needs (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A model folder or weight file that cannot be loaded; the message names the file or tensor."""


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only numpy arrays (memory-mapped)."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors file (header claims {header_len} bytes, "
                f"file has {size - 8} after the length field)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    buffer = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt or unsupported header entry for tensor {name!r}: {entry!r}") from None
        expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if end - begin != expected or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but dtype {entry['dtype']} shape {shape} "
                f"needs {expected}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {data_start + end}, "
                f"file has {size} bytes"
            )
        tensors[name] = buffer[data_start + begin : data_start + end].view(dtype).reshape(shape)
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt safetensors index ({e!r})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files in the model folder")
    return files


def load_hf_folder(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Decoder]:
    """Reads `path/config.json` and its safetensors weights (single file or sharded with an index)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist or is not a directory")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    try:
        config_dict = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    config = ModelConfig.from_hf_dict(config_dict)
    state_dict: dict[str, np.ndarray] = {}
    for file in _weight_files(folder):
        state_dict.update(read_safetensors(file))
    return config, decoder_from_state_dict(config, state_dict, dtype)


def decoder_from_state_dict(config: ModelConfig, state_dict: dict[str, np.ndarray], dtype=jnp.float32) -> Decoder:
    """Builds a `Decoder` whose parameters are the HF-named arrays of `state_dict`.

    Every parameter the config calls for must be present with HF's shape (`nn.Linear.weight` is
    `[out_features, in_features]`); leftover tensors other than known non-weights are an error too,
    as they mean the config and the weights disagree (e.g. a wrong layer count). `lm_head.weight` of
    a tied model is ignored.
    """
    # Build the module tree without materialising random weights, then fill every leaf.
    model = nnx.eval_shape(lambda: Decoder(config, dtype, rngs=nnx.Rngs(0)))
    remaining = dict(state_dict)

    def assign(param: nnx.Param, name: str, transpose: bool = False):
        if name not in remaining:
            raise CheckpointError(f"missing tensor {name!r} (a {config.architecture} model with this config needs it)")
        array = np.asarray(remaining.pop(name))
        expected = tuple(reversed(param.shape)) if transpose else tuple(param.shape)
        if array.shape != expected:
            raise CheckpointError(f"tensor {name!r} has shape {array.shape}, expected {expected}")
        if transpose:
            array = array.T
        param.set_value(jnp.asarray(array, dtype))

    def assign_linear(linear, prefix: str):
        assign(linear.kernel, prefix + ".weight", transpose=True)
        if linear.bias is not None:
            assign(linear.bias, prefix + ".bias")

    assign(model.embed_tokens, "model.embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        assign(layer.input_norm.weight, f"{p}.input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assign_linear(getattr(layer, proj), f"{p}.self_attn.{proj}")
        if layer.q_norm is not None:
            assign(layer.q_norm.weight, f"{p}.self_attn.q_norm.weight")
            assign(layer.k_norm.weight, f"{p}.self_attn.k_norm.weight")
        assign(layer.post_attention_norm.weight, f"{p}.post_attention_layernorm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assign_linear(getattr(layer, proj), f"{p}.mlp.{proj}")
    assign(model.norm.weight, "model.norm.weight")
    if model.lm_head is not None:
        assign_linear(model.lm_head, "lm_head")
    else:
        remaining.pop("lm_head.weight", None)

    leftover = sorted(n for n in remaining if not n.endswith(_IGNORED_SUFFIXES))
    if leftover:
        shown = ", ".join(repr(n) for n in leftover[:5]) + (" ..." if len(leftover) > 5 else "")
        raise CheckpointError(
            f"{len(leftover)} tensor(s) not used by a {config.architecture} model with "
            f"{config.num_layers} layers: {shown}"
        )
    unfilled = [p for p, var in nnx.to_flat_state(nnx.state(model)) if isinstance(var.get_value(), jax.ShapeDtypeStruct)]
    assert not unfilled, f"parameters left unassigned by the HF mapping: {unfilled}"
    return model
