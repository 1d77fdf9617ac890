"""Default sampling parameters from the model's generation config (vLLM's
generation_config="auto"): a HF folder's generation_config.json read as vLLM reads it, a GGUF's
llama.cpp sampler metadata, vLLM's defaults where there is none; used by Engine.add_request,
LLM.generate / chat and the server when a request brings no SamplingParams."""

from __future__ import annotations

import json
import shutil

import pytest

from tangram_jax.engine.config import EngineConfig, EngineConfigError
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.llm import LLM
from tangram_jax.models.generation_config import (GenerationConfigError, default_sampling_params,
                                                  sampling_overrides)
from tangram_jax.models.registry import default_model_path
from tangram_jax.sampling import SamplingParams
from tangram_jax.server.protocol import ChatCompletionRequest
from test_gguf import _hf_state_dict, write_tiny_gguf
from tiny_engine import build_tiny_model, tiny_engine_config

# Llama-3.1-Instruct's generation_config.json plus a length: top_k 50 is transformers' own
# default, which `to_diff_dict` drops (vLLM then keeps its top_k 0); do_sample is not read.
LLAMA_LIKE = {"bos_token_id": 1, "eos_token_id": [2], "do_sample": True, "temperature": 0.6,
              "top_p": 0.9, "top_k": 50, "max_new_tokens": 5, "transformers_version": "4.45.0"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    plain = build_tiny_model(tmp_path_factory.mktemp("plain"))
    greedy = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(plain, greedy)
    (greedy / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 6, "repetition_penalty": 1.0}))
    return plain, greedy


def test_hf_generation_config_is_read_as_vllm_reads_it(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(LLAMA_LIKE))
    overrides, origin = sampling_overrides("auto", tmp_path)
    assert overrides == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    assert origin.endswith("generation_config.json")
    params, _ = default_sampling_params("auto", tmp_path)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, -1, 5)
    # "vllm": its neutral defaults whatever the model says; a folder: that folder's file.
    assert default_sampling_params("vllm", tmp_path)[0] == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.05}))
    assert sampling_overrides(str(other), tmp_path)[0] == {"top_k": 20, "min_p": 0.05}
    # A folder without the file, or values SamplingParams refuses: one error naming the file.
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        sampling_overrides(str(tmp_path / "missing"), tmp_path)
    (other / "generation_config.json").write_text(json.dumps({"temperature": 3.5}))
    with pytest.raises(GenerationConfigError, match=r"other/generation_config.json: temperature "
                                                    r"must be in \[0, 2\], got 3.5"):
        default_sampling_params(str(other), None)


def test_gguf_sampling_metadata_and_the_embedded_model(tmp_path):
    path = write_tiny_gguf(tmp_path / "sampling.gguf", _hf_state_dict(), metadata={
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40,
        "general.sampling.top_p": 0.8, "general.sampling.min_p": 0.05})
    overrides, origin = sampling_overrides("auto", path)
    assert overrides == pytest.approx({"temperature": 0.7, "top_k": 40, "top_p": 0.8,
                                       "min_p": 0.05})
    assert "general.sampling" in origin
    bare = write_tiny_gguf(tmp_path / "bare.gguf", _hf_state_dict())
    assert sampling_overrides("auto", bare)[0] == {}
    # The embedded SmolLM2 GGUF carries no sampler metadata: vLLM's defaults, said so.
    overrides, origin = sampling_overrides("auto", default_model_path())
    assert overrides == {} and "vLLM's defaults" in origin
    # A model built in memory has no source.
    assert sampling_overrides("auto", None)[0] == {}


def test_requests_without_sampling_params_take_the_models_defaults(folders):
    plain, greedy = folders
    engine = Engine(tiny_engine_config(greedy, "full"))
    assert engine.default_sampling_params == SamplingParams(temperature=0.0, max_tokens=6)
    explicit = SamplingParams(temperature=0, max_tokens=6)
    rid_default = engine.add_request(prompt_token_ids=[5, 6, 7])
    rid_explicit = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=explicit)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    a, b = outs[rid_default].outputs[0], outs[rid_explicit].outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 6
    # LLM.generate / chat with no SamplingParams, and vLLM's accessor.
    llm = LLM(config=tiny_engine_config(greedy, "full"))
    assert llm.get_default_sampling_params() == engine.default_sampling_params
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert out.outputs[0].token_ids == a.token_ids
    conv = [{"role": "user", "content": "hi"}]
    assert llm.chat([conv], use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat([conv], explicit, use_tqdm=False)[0].outputs[0].token_ids
    # An OpenAI request's left-out sampler fields take them too; given ones win.
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = body.sampling_params(None, engine.default_sampling_params)
    assert p.temperature == 0.0
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.5)
    assert body.sampling_params(None, engine.default_sampling_params).temperature == 0.5
    # No generation config: vLLM's defaults; generation_config="vllm" ignores the file.
    assert Engine(tiny_engine_config(plain, "full")).default_sampling_params == SamplingParams()
    assert Engine(tiny_engine_config(greedy, "full", generation_config="vllm"))\
        .default_sampling_params == SamplingParams()


def test_generation_config_field_is_checked(folders, tmp_path):
    _, greedy = folders
    with pytest.raises(EngineConfigError, match="generation_config must be"):
        EngineConfig(generation_config="")
    with pytest.raises(EngineConfigError, match="generation_config must be"):
        EngineConfig(generation_config=None)
    with pytest.raises(EngineConfigError, match="no generation_config.json"):
        Engine(tiny_engine_config(greedy, "full", generation_config=str(tmp_path)))


TINY_CHAT = ["--mode", "full", "--max-model-len", "256", "--chunk-size", "16",
             "--kv-cache-tokens", "1024", "--max-num-seqs", "2", "--max-tokens", "4"]


def test_chat_help_shows_every_default(capsys):
    from tangram_jax.cli import main
    with pytest.raises(SystemExit) as e:
        main(["chat", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "longest answer per turn (default: 256)" in text
    for flag, vllm_default in (("--temperature", "1.0"), ("--top-p", "1.0"),
                               ("--top-k", "0 (off)"), ("--min-p", "0.0"),
                               ("--repetition-penalty", "1.0")):
        assert (f"{flag} {flag[2:].upper().replace('-', '_')} default: the model's generation "
                f"config (see --generation-config), else vLLM's {vllm_default}") in text, flag
    assert "sampling seed (default: each answer's seed derives from the request id" in text
    assert "--generation-config GENERATION_CONFIG default sampling parameters" in text


def test_chat_samples_with_the_models_defaults_unless_a_flag_says_otherwise(folders, monkeypatch,
                                                                             capsys):
    import io

    from tangram_jax.cli import main
    _, greedy = folders
    for flags, shown in (([], "temperature 0, top_p 1"), (["--temperature", "0.5"],
                                                          "temperature 0.5, top_p 1")):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
        assert main(["chat", "--model", str(greedy), *TINY_CHAT, *flags]) == 0
        banner = capsys.readouterr().out.splitlines()[1]
        assert banner.startswith(f"sampling: {shown}, top_k off"), banner
        assert "answers up to 4 tokens" in banner and "generation_config.json" in banner, banner
