"""`tangram-jax serve` warms its engine up for the requests clients send, log-probabilities
included: after it no request compiles anything (the tiny model of tests/tiny_engine.py)."""

from __future__ import annotations

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams
from tiny_engine import build_tiny_model, tiny_engine_config

PROMPT = "the cat sat on the mat and then the cat ran off to see the dog, " * 2 + "yes"



def test_a_server_warm_up_leaves_nothing_to_compile_for_logprob_requests(tmp_path):
    """`tangram-jax serve` warms the engine up with the log-prob variants (`warmup(logprobs=
    True)`): requests asking for top-k log-probs (any count), the whole distribution, prompt
    log-probs or several samples (their fork's page copies, block-table writes of any size)
    then run no XLA compilation (the server compiled them while clients waited)."""
    import jax
    folder = build_tiny_model(tmp_path / "tiny")
    engine = Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(2,),
                                       max_model_len=160))
    assert engine.is_warm
    engine.warmup(logprobs=True)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, logprobs=20,
                                  prompt_logprobs=3),
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=-1),
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                                  n=2)):
        for prompt in (PROMPT, "hi"):
            engine.add_request(prompt=prompt, sampling_params=params)
        outs = [o for o in engine.stream() if o.finished]
        assert len(outs) == 2 and all(len(c.token_ids) == 8 for o in outs for c in o.outputs)
        assert compiles == [], (params, compiles)
