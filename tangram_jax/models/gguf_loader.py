"""Reading a GGUF file (llama.cpp's format) into what the HF-folder path also produces.

`read_gguf(path)` returns three things, so the rest of the package never sees GGUF names:

- a Hugging Face `config.json`-style dict (for `ModelConfig.from_hf_dict`);
- a state dict `{HF parameter name: float32 array in HF layout [out, in]}`, every quantized
  tensor dequantized with the `gguf` package;
- a `GGUFTokenizerSpec` (vocabulary, merges, special ids, chat template) for `Tokenizer`.

llama.cpp's converter stores the llama-arch q_proj/k_proj rows permuted: within each head, HF's
rotate-half layout (first half of the head dims, then second half) is interleaved into pairs
(x0, x_{d/2}, x1, x_{d/2+1}, ...) because ggml's RoPE rotates adjacent pairs. `_unpermute_rows`
inverts exactly that reshape, so the weights match the HF checkpoint the file was made from.
Qwen2/Qwen3 GGUFs are written without this permutation (llama.cpp uses NEOX RoPE for them).

Gemma-3 (text): no permutation either; llama.cpp stores every RMSNorm weight as 1 + w (its norm
scales by the weight, Gemma's by 1 + w), so 1 is subtracted back, as transformers' GGUF loader
does; `ffn_norm` is Gemma's pre-feedforward norm and `post_attention_norm` / `post_ffw_norm` its
output norms. What the file does not say (the local layers' RoPE base, the local/global pattern,
query_pre_attn_scalar) takes transformers' Gemma-3 defaults, as its GGUF loader does.
Quantised tensors (Q4_K, Q5_0, Q6_K, Q8_0, ... any type the `gguf` package dequantises) become
float32.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import numpy as np


class GGUFError(ValueError):
    """The file is not a usable GGUF (truncated, corrupt, or describes an unsupported model)."""


# GGUF `general.architecture` -> (HF model_type, HF class name).
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Architectures whose Q/K rows llama.cpp's converter permutes for interleaved RoPE.
_PERMUTED_QK = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma-3's names where they differ (its ffn_norm is the pre-feedforward norm).
_GEMMA_BLOCK_NAMES = dict(_BLOCK_NAMES, **{
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
})
# Architectures whose norms llama.cpp stores as 1 + w.
_UNIT_OFFSET_NORMS = ("gemma3",)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The tokenizer a GGUF describes (llama.cpp's `tokenizer.ggml.*` keys)."""

    model: str  # "gpt2" = byte-level BPE; "llama" = sentencepiece (not supported by Tokenizer)
    pre: str | None  # llama.cpp's pre-tokenizer name, e.g. "smollm", "llama-bpe", "qwen2"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    architecture: str | None = None   # general.architecture (sentencepiece rules differ by family)


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray], GGUFTokenizerSpec]:
    """(HF config dict, HF-named float32 state dict, tokenizer spec) of a GGUF file."""
    reader = open_gguf(path)
    config = hf_config_from_metadata(reader)
    state_dict = _state_dict(reader, config)
    return config, state_dict, tokenizer_spec_from_metadata(reader)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` on `path`, after checking the file is complete. One reader a file
    version (path, size, modification time) is kept: building one parses every metadata field
    in Python (2.2 s for the embedded model's vocabulary), and loading a model asks for its
    weights' dtype, its sampling defaults and its tensors. Readers are read-only."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


SUMMARY_VERSION = 1


def gguf_summary(path: str | os.PathLike) -> dict:
    """What a load reads from a GGUF file before its weights: ``{"weight_dtype": "bfloat16" |
    "float16" | "float32" (what most weight elements are stored in; quantised files count as
    float32, they are dequantised to it), "sampling": {key: value} (its ``general.sampling.*``
    fields)}``.

    Kept as a small JSON in the model cache (`checkpoint.cache_root()` / gguf-summaries, keyed
    by the file's path, size and modification time), so a start whose weights come from the
    converted-model cache does not parse the file at all: the reader parses every metadata
    field in Python, 2.2 s of the README's main job on 2 cores (the vocabulary's strings). An
    unreadable or unwritable summary is recomputed from the file."""
    import hashlib
    import json

    from tangram_jax.atomic_files import write_text_atomic
    from tangram_jax.models.checkpoint import cache_root

    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    key = {"version": SUMMARY_VERSION, "source": str(path), "size": stat.st_size,
           "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    stored = cache_root() / "gguf-summaries" / f"{path.stem}-{digest}.json"
    try:
        record = json.loads(stored.read_text(encoding="utf-8"))
        if record.get("key") == key:
            return record["summary"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    reader = open_gguf(path)
    elements: dict[str, int] = {}
    for t in reader.tensors:
        kind = {"BF16": "bfloat16", "F16": "float16"}.get(t.tensor_type.name, "float32")
        elements[kind] = elements.get(kind, 0) + int(t.n_elements)
    summary = {"weight_dtype": max(elements, key=elements.get) if elements else "float32",
               "sampling": {name: np.asarray(field.contents()).item()
                            for name, field in reader.fields.items()
                            if name.startswith("general.sampling.")}}
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(stored, json.dumps({"key": key, "summary": summary}))
        _prune_summaries(stored.parent, key)
    except OSError:   # a read-only or full disk: the next start parses the file again
        pass
    return summary


def _prune_summaries(folder: Path, current: dict) -> None:
    """Remove the summaries of files that are gone and of older versions of `current`'s."""
    import json

    for other in folder.glob("*.json"):
        if other.name.startswith("."):   # another process's summary being written
            continue
        try:
            key = json.loads(other.read_text(encoding="utf-8"))["key"]
            stale = key != current and (key["source"] == current["source"]
                                        or not Path(key["source"]).is_file())
        except (OSError, ValueError, KeyError, TypeError):
            stale = True
        if stale:
            other.unlink(missing_ok=True)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, size: int, mtime_ns: int):
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on a cut-off header
        raise GGUFError(f"{path}: cannot read the file ({type(e).__name__}: {e}); "
                        f"the file is truncated or corrupt") from e
    # The memory map does not notice a short file; the last tensor's bytes must be inside it.
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{path} is truncated: tensor data runs to byte {end} but the file has {size}")
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_config_from_metadata(reader) -> dict:
    """An HF `config.json` dict from GGUF metadata (the keys transformers' GGUF loader maps)."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    model_type, class_name = _ARCHITECTURES[arch]

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        # Llama-3.1-style RoPE scaling is baked into per-frequency factors; the scaling
        # parameters our RoPE needs are not in the file.
        raise GGUFError("GGUF files with rope_freqs (Llama-3.1 RoPE scaling) are not supported; "
                        "load the Hugging Face folder instead")
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise GGUFError(f"GGUF RoPE scaling {scaling_type!r} is not supported")

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length")
                   or _field(reader, f"{arch}.rope.dimension_count") or hidden // heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(tokens.data) if tokens is not None else _tensor(reader, "token_embd.weight").shape[1]
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh" if arch == "gemma3" else "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _shortest_float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    return config


def _shortest_float(value) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.999999747e-06. Return the shortest
    decimal that is the same float32 (the value config.json had)."""
    return float(str(np.float32(value)))


def _tensor(reader, name):
    for t in reader.tensors:
        if t.name == name:
            return t
    raise GGUFError(f"GGUF has no tensor {name!r}")


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, [d/2 pairs, 2] back to [2 halves, d/2].

    llama.cpp: `w.reshape(n_heads, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)`.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _state_dict(reader, config: dict) -> dict[str, np.ndarray]:
    import gguf

    arch = _field(reader, "general.architecture")
    state = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            raise GGUFError(f"unexpected tensor {t.name!r} in a {arch} GGUF")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"tensor {t.name}: quantization {t.tensor_type.name} is not supported "
                            f"by the installed gguf package") from e
        # ggml lists dims innermost-first; the row-major array is [out, in], HF's layout.
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                   "k_proj.bias")):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            w = _unpermute_rows(w, heads)
        if arch in _UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
            w = w - 1.0
        state[name] = w
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in state]
    for i in range(config["num_hidden_layers"]):
        for suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                       "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                       "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            if f"model.layers.{i}.{suffix}" not in state:
                missing.append(f"model.layers.{i}.{suffix}")
    if missing:
        raise GGUFError(f"GGUF is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return state


def tokenizer_spec_from_metadata(reader) -> GGUFTokenizerSpec:
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")

    def opt_int(key):
        value = _field(reader, key)
        return None if value is None else int(value)

    return GGUFTokenizerSpec(
        model=str(model),
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=list(tokens),
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))],
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        eot_token_id=opt_int("tokenizer.ggml.eot_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        architecture=_field(reader, "general.architecture"),
    )
