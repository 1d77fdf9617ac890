"""Loads a Hugging Face model folder (config.json + *.safetensors) into a `Decoder`.

`decoder_from_state_dict` is the one place that maps HF parameter names onto the decoder; the GGUF
loader produces an HF-named state dict and goes through it too.

Weights are read with the `safetensors` library (`safe_open(framework="numpy")`, which maps the
file and gives bfloat16 tensors as `ml_dtypes.bfloat16` arrays). A truncated or corrupt file is
reported by name as a `CheckpointError` instead of the library's bare message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import Decoder

# Checkpoint entries that carry no weights the decoder needs (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A model folder or weight file that cannot be loaded; the message names the file or tensor."""


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy arrays."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        # The library's header checks: a bad JSON header is corrupt; a header or data region
        # that does not fit the file means the file was cut short.
        kind = "corrupt safetensors header" if "JSON" in str(e) else \
            "truncated or damaged safetensors file"
        raise CheckpointError(f"{path}: {kind} ({e})") from None


def checkpoint_dtype(folder: str | os.PathLike) -> str | None:
    """The floating dtype a HF folder's weights are stored in ("float32", "bfloat16",
    "float16"), from config.json's `torch_dtype` / `dtype`, else from the first floating tensor
    of the weight files; None when neither says."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named in ("float32", "bfloat16", "float16"):
        return named
    from safetensors import safe_open

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    stored = names.get(f.get_slice(key).get_dtype())
                    if stored is not None:
                        return stored
        except Exception:
            return None   # unreadable: the load reports it by name
    return None


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
    config_dict, state_dict = read_hf_folder(path)
    config = ModelConfig.from_hf_dict(config_dict)
    return config, decoder_from_state_dict(config, state_dict, dtype)


def read_hf_config(path: str | os.PathLike) -> dict:
    """config.json of a model folder as a dict, validated (`ModelConfig.from_hf_dict`:
    unsupported models fail before any weight is read)."""
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
    ModelConfig.from_hf_dict(config_dict)
    return config_dict


def read_hf_folder(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, HF-named state dict) of a model folder; the config is validated."""
    folder = Path(path)
    config_dict = read_hf_config(folder)
    state_dict: dict[str, np.ndarray] = {}
    for file in _weight_files(folder):
        state_dict.update(read_safetensors(file))
    return config_dict, state_dict


def decoder_from_state_dict(config: ModelConfig, state_dict: dict[str, np.ndarray], dtype=jnp.float32) -> Decoder:
    """Builds a `Decoder` whose parameters are the HF-named arrays of `state_dict`.

    Every parameter the config calls for must be present with HF's shape (`nn.Linear.weight` is
    `[out_features, in_features]`); leftover tensors other than known non-weights are an error too,
    as they mean the config and the weights disagree (e.g. a wrong layer count). `lm_head.weight` of
    a tied model is ignored.
    """
    # Build the module tree without materialising random weights, then fill every leaf.
    model = Decoder.abstract(config, dtype)
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
    gemma = config.sandwich_norms
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        assign(layer.input_norm.weight, f"{p}.input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assign_linear(getattr(layer, proj), f"{p}.self_attn.{proj}")
        if layer.q_norm is not None:
            assign(layer.q_norm.weight, f"{p}.self_attn.q_norm.weight")
            assign(layer.k_norm.weight, f"{p}.self_attn.k_norm.weight")
        if layer.sinks is not None:
            assign(layer.sinks, f"{p}.self_attn.sinks")
        if gemma:   # HF's post_attention_layernorm norms Gemma's attention output
            assign(layer.attn_output_norm.weight, f"{p}.post_attention_layernorm.weight")
            assign(layer.post_attention_norm.weight, f"{p}.pre_feedforward_layernorm.weight")
            assign(layer.mlp_output_norm.weight, f"{p}.post_feedforward_layernorm.weight")
        else:
            assign(layer.post_attention_norm.weight, f"{p}.post_attention_layernorm.weight")
        if layer.moe is not None:
            _assign_experts(layer.moe, f"{p}.mlp", config, remaining, assign)
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assign_linear(getattr(layer, proj), f"{p}.mlp.{proj}")
    assign(model.norm.weight, "model.norm.weight")
    if model.lm_head is not None:
        assign_linear(model.lm_head, "lm_head")
    else:
        remaining.pop("lm_head.weight", None)
    model.set_constants()

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


def _assign_experts(moe, prefix: str, config: ModelConfig, remaining: dict, assign) -> None:
    """The router and experts of one MoE layer from either checkpoint layout.

    Qwen3-MoE (as saved on the Hub and by transformers): `mlp.gate.weight` [E, D] and per expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight` (HF [out, in]), or transformers' fused
    `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I]. GPT-OSS: `mlp.router.weight`
    [E, D] and `.bias`, `mlp.experts.gate_up_proj` [E, D, 2I] with gate and up columns
    interleaved (split here into gate columns then up columns), `down_proj` [E, I, D], and
    their biases; the Hub's GPT-OSS experts are MXFP4 (`dequantize_mxfp4`)."""
    e = config.moe.num_experts
    if config.architecture == "gpt_oss":
        for proj in ("gate_up_proj", "down_proj"):   # the Hub's MXFP4 experts
            name = f"{prefix}.experts.{proj}"
            if name + "_blocks" in remaining:
                if name + "_scales" not in remaining:
                    raise CheckpointError(f"{name}_blocks has no {name}_scales beside it")
                remaining[name] = dequantize_mxfp4(remaining.pop(name + "_blocks"),
                                                   remaining.pop(name + "_scales"))
        assign(moe.router, f"{prefix}.router.weight", transpose=True)
        assign(moe.router_bias, f"{prefix}.router.bias")

        def deinterleave(name):
            w = np.asarray(remaining.get(name, np.empty(0)))
            if w.ndim:
                remaining[name] = np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)

        deinterleave(f"{prefix}.experts.gate_up_proj")
        deinterleave(f"{prefix}.experts.gate_up_proj_bias")
        assign(moe.gate_up, f"{prefix}.experts.gate_up_proj")
        assign(moe.gate_up_bias, f"{prefix}.experts.gate_up_proj_bias")
        assign(moe.down, f"{prefix}.experts.down_proj")
        assign(moe.down_bias, f"{prefix}.experts.down_proj_bias")
        return
    assign(moe.router, f"{prefix}.gate.weight", transpose=True)
    fused = f"{prefix}.experts.gate_up_proj"
    if fused not in remaining:
        # Per-expert HF tensors [out, in] -> [E, in, out] (gate columns, then up columns).
        try:
            gate = [remaining.pop(f"{prefix}.experts.{j}.gate_proj.weight") for j in range(e)]
            up = [remaining.pop(f"{prefix}.experts.{j}.up_proj.weight") for j in range(e)]
            down = [remaining.pop(f"{prefix}.experts.{j}.down_proj.weight") for j in range(e)]
        except KeyError as missing:
            raise CheckpointError(f"missing tensor {missing.args[0]!r} (a {config.architecture} "
                                  f"model with {e} experts needs it)") from None
        remaining[fused] = np.stack([np.concatenate([g, u], axis=0).T for g, u in zip(gate, up)])
        remaining[f"{prefix}.experts.down_proj"] = np.stack([np.asarray(d).T for d in down])
    else:   # transformers' fused layout: [E, 2I, D] and [E, D, I], HF [out, in] per expert
        remaining[fused] = np.swapaxes(np.asarray(remaining[fused]), 1, 2)
        name = f"{prefix}.experts.down_proj"
        if name in remaining:
            remaining[name] = np.swapaxes(np.asarray(remaining[name]), 1, 2)
    assign(moe.gate_up, fused)
    assign(moe.down, f"{prefix}.experts.down_proj")


# MXFP4's 4-bit values (E2M1), by code.
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS's MXFP4 expert weights as float32 in the unquantized checkpoint's layout.

    blocks uint8 [E, out, in / 32, 16] (two 4-bit codes a byte, low nibble first) and scales
    uint8 [E, out, in / 32] (a power of two 2^(s - 127) per 32 values) -> [E, in, out], as
    transformers' `convert_moe_packed_tensors`."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree")
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = _FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = _FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    e, out, groups, width = values.shape
    return np.swapaxes(values.reshape(e, out, groups * width), 1, 2)
