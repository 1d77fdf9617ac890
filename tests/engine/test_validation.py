"""Validation at the boundary: SamplingParams, EngineConfig, request inputs, profile files, and
batch calls that check every item before queuing any (issue 15's failure classes)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from tangram_jax.compression.profile import BudgetProfile, ProfileError
from tangram_jax.engine.config import EngineConfig, EngineConfigError, add_cli_args, from_cli_args
from tangram_jax.engine.llm_engine import Engine
from tangram_jax.llm import LLM
from tangram_jax.sampling import SamplingParams
from tangram_jax.scheduler.metrics import SchedulerMetrics
from tiny_engine import CONFIG, tiny_engine_config, tiny_profile

VOCAB = CONFIG["vocab_size"]


# ----- SamplingParams ------------------------------------------------------------------------

def test_sampling_params_are_immutable_after_validation():
    p = SamplingParams(max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = -5
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=-5)   # a changed copy is validated again
    assert dataclasses.replace(p, max_tokens=8).max_tokens == 8


def test_numpy_scalars_are_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5),
                       max_tokens=np.int32(7), seed=np.uint32(3), stop_token_ids=np.array([1, 2]))
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.max_tokens) is int
    assert p.stop_token_ids == (1, 2) and p.seed == 3


@pytest.mark.parametrize("kwargs, error, field", [
    ({"top_k": -2}, ValueError, "top_k"),
    ({"temperature": 2.5}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": True}, TypeError, "temperature"),
    ({"top_p": np.bool_(True)}, TypeError, "top_p"),
    ({"max_tokens": 3.0}, TypeError, "max_tokens"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"stop": b"x"}, TypeError, "stop"),
    ({"stop": {"a": 1}}, TypeError, "stop"),
    ({"stop": "a\ud800"}, ValueError, "stop"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": [True]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, ValueError, "stop_token_ids"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos"),
])
def test_sampling_params_refuse_with_the_field_name(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


# ----- EngineConfig --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"ratio": True}, "ratio"), ({"ratio": 0}, "ratio"), ({"ratio": "0.5"}, "ratio"),
    ({"num_pages": 2.5}, "num_pages"), ({"num_pages": 1}, "num_pages"),
    ({"async_scheduling": "no"}, "async_scheduling"), ({"warmup": 1}, "warmup"),
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": -5}, "max_model_len"),
    ({"decode_buckets": ()}, "decode_buckets"), ({"decode_buckets": (0, 4)}, "decode_buckets"),
    ({"decode_buckets": "1,2"}, "decode_buckets"), ({"mode": "fast"}, "mode"),
    ({"dtype": "float16"}, "dtype"), ({"layer_loop": "vmap"}, "layer_loop"),
    ({"page_size": 0}, "page_size"), ({"chunk_size": True}, "chunk_size"),
    ({"max_num_seqs": np.float64(4)}, "max_num_seqs"), ({"group_size": 0}, "group_size"),
    ({"profile": 3}, "profile"), ({"model": ""}, "model"), ({"seed": -1}, "seed"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"chat_template": ""}, "chat_template"), ({"chat_template": 3}, "chat_template"),
])
def test_engine_config_fields_name_field_and_value(kwargs, field):
    with pytest.raises(EngineConfigError, match=field) as e:
        EngineConfig(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(e.value)


def test_an_engine_formats_chats_with_the_chat_template_it_is_given(tiny_folder, tmp_path):
    """EngineConfig.chat_template (vLLM's --chat-template) replaces the model's template for
    every chat the engine formats; a value that is neither a file nor a template is refused
    when the engine is built, naming it."""
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}", encoding="utf-8")
    engine = Engine(tiny_engine_config(tiny_folder, "full", chat_template=str(path)))
    assert engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    with pytest.raises(EngineConfigError, match="chat_template.*'nothing-here'"):
        Engine(tiny_engine_config(tiny_folder, "full", chat_template="nothing-here"))


def test_engine_config_checks_assignments_too():
    cfg = EngineConfig(max_num_seqs=np.int64(4))
    assert type(cfg.max_num_seqs) is int
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        cfg.max_num_seqs = -1
    with pytest.raises(AttributeError, match="no field"):
        cfg.max_num_seq = 4   # a typo is not silently a new attribute


def test_every_field_has_a_check_and_help():
    for f in dataclasses.fields(EngineConfig):
        assert callable(f.metadata.get("check")) and f.metadata.get("help"), f.name


def test_resolve_computes_every_derived_setting_once(tiny_folder):
    from tangram_jax.models.config import ModelConfig
    mc = ModelConfig.from_hf_dict(CONFIG)
    rc = EngineConfig(mode="full", max_num_seqs=6, chunk_size=16, page_size=8,
                      decode_buckets=(1, 2, 4, 8, 16)).resolve(mc)
    assert rc.decode_buckets == (1, 2, 4, 8)        # the first bucket holding 6 rows ends them
    assert rc.max_num_batched_tokens == 512          # the default, above 6 + 16
    assert rc.max_model_len == CONFIG["max_position_embeddings"]
    rc = EngineConfig(mode="full", max_num_seqs=600, chunk_size=16).resolve(mc)
    assert rc.max_num_batched_tokens == 616 and rc.decode_buckets[-1] == 600
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens 100 is below"):
        EngineConfig(mode="full", max_num_seqs=90, chunk_size=16,
                     max_num_batched_tokens=100).resolve(mc)
    with pytest.raises(EngineConfigError, match="max_model_len 4096 exceeds"):
        EngineConfig(mode="full", max_model_len=4096).resolve(mc)
    with pytest.raises(EngineConfigError, match="only used in tangram mode"):
        EngineConfig(mode="full", profile="p.json").resolve(mc)


def test_a_token_budget_below_a_chunk_is_refused_when_the_config_is_made():
    """max_num_batched_tokens must hold a full decode batch plus one compression chunk: refused
    by the constructor (as vLLM's configs refuse theirs), not first by the Engine."""
    with pytest.raises(EngineConfigError, match=r"max_num_batched_tokens 8 is below max_num_seqs"
                                                r" \+ chunk_size = 16 \+ 16 = 32"):
        EngineConfig(max_num_batched_tokens=8, chunk_size=16)
    with pytest.raises(EngineConfigError, match=r"= 2 \+ 16 = 18"):
        EngineConfig(max_num_batched_tokens=17, chunk_size=16, max_num_seqs=2)
    # chunk_size left to its default (2048 on every backend), named as such.
    with pytest.raises(EngineConfigError, match=r"16 \+ 2048 = 2064 \(chunk_size's default"):
        EngineConfig(max_num_batched_tokens=8)
    assert EngineConfig(max_num_batched_tokens=18, chunk_size=16, max_num_seqs=2)\
        .max_num_batched_tokens == 18


def test_cli_flags_are_generated_from_the_fields():
    parser = argparse.ArgumentParser()
    add_cli_args(parser, exclude=("seed",))
    args = parser.parse_args(["--mode", "full", "--max-num-seqs", "3", "--decode-buckets", "1,4",
                              "--no-async-scheduling", "--ratio", "0.25"])
    cfg = from_cli_args(args)
    assert (cfg.mode, cfg.max_num_seqs, cfg.decode_buckets, cfg.async_scheduling, cfg.ratio) == \
        ("full", 3, (1, 4), False, 0.25)
    assert not hasattr(args, "seed")
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        from_cli_args(parser.parse_args(["--max-num-seqs", "0"]))


# ----- profile files -------------------------------------------------------------------------

def test_profile_files_fail_with_one_error_naming_the_file(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    latin = tmp_path / "latin1.json"
    latin.write_bytes(b'{"name": "caf\xe9"}')
    good = tiny_profile("tiny").to_dict()
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(dict(good, rho=True)))
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps(dict(good, metadata=[1])))
    for path, needle in ((deep, "nests"), (latin, "not UTF-8"), (wrong, "rho"),
                         (meta, "metadata"), (tmp_path / "missing.json", "cannot read")):
        with pytest.raises(ProfileError, match=needle) as e:
            BudgetProfile.load(path)
        assert str(path) in str(e.value)


# ----- metrics -------------------------------------------------------------------------------

def test_step_host_times_are_bounded():
    m = SchedulerMetrics(window=64)
    for i in range(10000):
        m.start_step(0.001)
        m.add_to_step(0.001)
    s = m.summary({})
    assert m.step_host_seconds.size == 64 and s["steps"] == 10000
    assert s["host_ms_per_step_mean"] == pytest.approx(2.0)
    assert s["host_ms_per_step_median"] == pytest.approx(2.0)


# ----- requests through the engine and LLM ---------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(config=tiny_engine_config(tiny_folder, "full"))


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(prompt=b"hello"), TypeError, "prompt must be a str, got bytes"),
    (dict(prompt="a\ud800b"), ValueError, "lone surrogate"),
    (dict(prompt_token_ids=5), TypeError, "prompt_token_ids must be a list of token ids"),
    (dict(prompt_token_ids=[1, 2.0]), TypeError, r"prompt_token_ids\[1\]"),
    (dict(prompt_token_ids=[True]), TypeError, "bool"),
    (dict(prompt_token_ids="abc"), TypeError, "got str"),
    (dict(prompt_token_ids=b"abc"), TypeError, "got bytes"),
    (dict(prompt_token_ids=np.array([1.0])), TypeError, "integer array"),
    (dict(prompt_token_ids=[VOCAB]), ValueError, "outside the vocabulary"),
    (dict(prompt="x", session_id=["x"]), TypeError, "session_id must be a non-empty str"),
    (dict(prompt="x", request_id=3), TypeError, "request_id must be a non-empty str"),
    (dict(prompt="x", sampling_params=SamplingParams(stop_token_ids=[VOCAB])), ValueError,
     "stop_token_ids"),
    (dict(messages=[{"role": "user", "content": "\udcff"}]), ValueError, "lone surrogate"),
    (dict(prompt="x", prompt_token_ids=[1]), ValueError, "exactly one of"),
])
def test_add_request_refuses_clearly_and_queues_nothing(llm, kwargs, error, needle):
    engine = llm.engine
    with pytest.raises(error, match=needle):
        engine.add_request(**kwargs)
    assert not engine.has_unfinished_requests()


def test_auto_ids_never_collide_with_caller_ids(llm):
    engine = llm.engine
    engine.add_request("request-0", prompt="a", sampling_params=GREEDY)
    engine.add_request("request-1", prompt="b", sampling_params=GREEDY)
    auto = engine.add_request(prompt="c", sampling_params=GREEDY)
    assert auto not in ("request-0", "request-1")
    with pytest.raises(ValueError, match="already live"):
        engine.add_request("request-0", prompt="d", sampling_params=GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("prompts", [
    ["Hello", ""], ["Hello", b"bytes"], ["Hello", [1, 2.5]], ["Hello", {"prompt": "x", "y": 1}],
    ["Hello", list(range(1, 200)) * 3],
])
def test_a_batch_is_checked_whole_before_anything_is_queued(llm, prompts):
    with pytest.raises((TypeError, ValueError), match=r"prompts\[1\]"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_generate_refuses_bytes_and_accepts_arrays(llm):
    with pytest.raises(TypeError, match="bytes"):
        llm.generate(b"hello", GREEDY, use_tqdm=False)
    outs = llm.generate([np.array([5, 6, 7]), {"prompt_token_ids": [5, 6, 7]}, [5, 6, 7]], GREEDY,
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        outs[2].outputs[0].token_ids
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_chat_with_the_same_conversation_twice(llm):
    conv = [{"role": "user", "content": "Hi"}]
    first = llm.chat([conv], GREEDY, use_tqdm=False)[0]
    follow = conv + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "More"}]
    outs = llm.chat([follow, follow], GREEDY, use_tqdm=False)
    assert len({o.session_id for o in outs}) == 2
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"conversations\[1\]"):
        llm.chat([conv, [{"role": "assistant", "content": "x"}]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_an_interrupted_batch_leaves_the_engine_usable(llm, monkeypatch):
    engine = llm.engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    monkeypatch.setattr(engine, "step", real_step)
    assert not engine.has_unfinished_requests()
    assert llm.generate(["three"], GREEDY, use_tqdm=False)[0].finished


def test_engine_and_config_kwargs_together_are_refused(tiny_folder):
    with pytest.raises(TypeError, match="not both"):
        Engine(tiny_engine_config(tiny_folder, "full"), mode="full")
    with pytest.raises(TypeError, match="not both"):
        LLM(config=tiny_engine_config(tiny_folder, "full"), mode="full")
