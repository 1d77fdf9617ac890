"""`tangram-jax serve` warms its engine up for the requests clients send, log-probabilities
included: after it no request compiles anything (the tiny model of tests/tiny_engine.py)."""

from __future__ import annotations

import pytest

from tangram_jax.engine.llm_engine import Engine
from tangram_jax.sampling import SamplingParams
from compile_events import compiles_on_this_thread
from tiny_engine import build_tiny_model, tiny_engine_config

PROMPT = "the cat sat on the mat and then the cat ran off to see the dog, " * 2 + "yes"



def _hold_background_compiles(monkeypatch, request):
    """The background compile thread waits for the returned event before each compile (set
    at the test's end too, so a failing test does not leave it waiting)."""
    import threading

    from tangram_jax.engine import step_compiler
    gate = threading.Event()
    request.addfinalizer(gate.set)
    check = step_compiler._check_memory_maps

    def held(*args):
        if threading.current_thread().name.startswith("tangram-background-compile"):
            assert gate.wait(120)
        check(*args)

    monkeypatch.setattr(step_compiler, "_check_memory_maps", held)
    return gate


def _greedy_answer(engine, **prompt) -> tuple[list, list]:
    """(token ids, their log-probs) of one greedy request of 6 tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    engine.add_request(sampling_params=params, **prompt)
    out = [o for o in engine.stream() if o.finished][0].outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


@pytest.mark.parametrize("overrides", [{"kv_precision": "k8v4"}, {"mode": "full"}],
                         ids=["tangram-k8v4", "full"])
def test_a_server_warm_up_leaves_nothing_to_compile_for_logprob_requests(tmp_path, overrides):
    """`tangram-jax serve` warms the engine up with the log-prob variants (`warmup(logprobs=
    True)`): requests asking for top-k log-probs (any count), the whole distribution, prompt
    log-probs or several samples (their fork's page copies, block-table writes of any size)
    then run no XLA compilation (the server compiled them while clients waited)."""
    import jax
    folder = build_tiny_model(tmp_path / "tiny")
    overrides = dict(overrides)
    engine = Engine(tiny_engine_config(folder, overrides.pop("mode", "tangram"), warmup=True,
                                       compile_cache_dir="off", max_num_seqs=2,
                                       decode_buckets=(2,), max_model_len=320, **overrides))
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
        for prompt in (PROMPT, "hi", PROMPT * 2):   # a long, a short and a longer prompt
            engine.add_request(prompt=prompt, sampling_params=params)
        outs = [o for o in engine.stream() if o.finished]
        assert len(outs) == 3 and all(len(c.token_ids) == 8 for o in outs for c in o.outputs)
        assert compiles == [], (params, compiles)
    # A session's follow-up turn (its history continued, only the new tokens prefilled).
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(prompt=PROMPT, sampling_params=greedy, session_id="s")
    turn = [o for o in engine.stream() if o.finished][0]
    engine.add_request(prompt_token_ids=[*turn.prompt_token_ids, *turn.outputs[0].token_ids,
                                         5, 6, 7], sampling_params=greedy, session_id="s")
    assert [o for o in engine.stream() if o.finished][0].num_cached_tokens > 0
    assert compiles == []


def test_penalty_requests_compile_nothing_after_warm_up(tmp_path):
    """Penalties, min_p and min_tokens, over histories of different lengths: the tokens they
    count are the slots' penalty rows on the device (`sampling.SlotState`), so every step keeps
    the shapes warm-up compiled."""
    import jax
    folder = build_tiny_model(tmp_path / "tiny")
    engine = Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(2,), max_model_len=320))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True,
                            presence_penalty=0.5, repetition_penalty=1.2, min_p=0.05,
                            min_tokens=4)
    for prompt in (PROMPT, "hi"):
        engine.add_request(prompt=prompt, sampling_params=params)
    assert len([o for o in engine.stream() if o.finished]) == 2
    assert compiles == []


def test_the_start_up_report_lists_every_compiled_program(tmp_path):
    """`Engine.startup_report`: every program warm-up compiled, with its shape key, compile
    seconds and HLO size; the count equals the runner's list of warm-up programs."""
    folder = build_tiny_model(tmp_path / "tiny")
    engine = Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(1, 2),
                                       max_model_len=160))
    assert engine.wait_for_compiles(120)   # decode bucket 1 compiles in the background
    report = engine.startup_report()
    programs = report["programs"]
    assert report["num_programs"] == len(programs) == len(engine.runner.warmup_programs(
        (1, 2), engine.config.max_prefill_rows, 2,
        max_page_copies=engine.model_config.num_layers * engine.layout.num_groups,
        max_swap_pages=engine.manager.block_tables[0].size))
    assert {p["program"] for p in programs} >= {"prefill", "decode", "sample", "copy_pages",
                                                 "host_copy_out", "host_copy_in"}
    assert all(p["compile_seconds"] > 0 and p["hlo_chars"] > 0 for p in programs)
    assert {p["key"]["bucket"] for p in programs if p["program"] == "decode"} == {1, 2}
    assert [p["compile_seconds"] for p in programs] == sorted(
        (p["compile_seconds"] for p in programs), reverse=True)
    assert set(report["seconds"]) == {"load_model", "load_wait", "build", "collect",
                                       "warmup", "total"}
    assert report["seconds"]["warmup"] <= report["seconds"]["total"]


def test_warm_up_near_the_memory_mapping_limit_stops_with_one_clear_error(tmp_path, monkeypatch):
    """Each program XLA compiles on a CPU keeps hundreds of memory mappings; a compile that
    finds none left dies with a segmentation fault. Near Linux's vm.max_map_count, warm-up
    refuses to start another compile and says what to change."""
    from tangram_jax.engine import step_compiler
    folder = build_tiny_model(tmp_path / "tiny")
    monkeypatch.setattr(step_compiler, "_memory_maps", lambda: (60_000, 65_530))
    with pytest.raises(step_compiler.MemoryMapLimitError,
                       match=r"60000 memory mappings of the 65530 .*vm\.max_map_count.*"
                             r"warmup=False"):
        Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                  max_num_seqs=2, decode_buckets=(1, 2), max_model_len=160))


def test_narrow_programs_compile_in_the_background_and_change_no_token(tmp_path, monkeypatch,
                                                                      request):
    """Warm-up leaves the short-region turn compaction (`SHORT_REGION_PAGES`) and the decode
    buckets below the largest to the background thread: until they are compiled, short turns
    run the whole-table program, decode steps the largest bucket, and nothing compiles on the
    serving thread; after it, they run their own programs, with the same tokens and
    log-probabilities."""
    import numpy as np

    folder = build_tiny_model(tmp_path / "tiny")
    gate = _hold_background_compiles(monkeypatch, request)
    engine = Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(1, 2),
                                       max_model_len=512, page_size=4))
    engine.warmup(logprobs=True)
    runner = engine.runner
    short_width, whole = runner._region_widths()
    assert short_width == 64 and engine.startup_report()["compiling"] >= 1
    assert runner._region_width(3) == whole   # the narrow programs are not compiled yet
    assert runner._ready_decode_bucket(1) == 2

    compiles = compiles_on_this_thread()
    covering = _greedy_answer(engine, prompt=PROMPT)
    gate.set()
    assert compiles == []
    assert engine.wait_for_compiles(120)
    assert runner._region_width(3) == short_width and engine.startup_report()["compiling"] == 0
    assert runner._ready_decode_bucket(1) == 1
    background = [r["key"] for r in engine.startup_report()["programs"]
                  if r["phase"] == "background"]
    assert {k.get("region_pages") for k in background} >= {64}
    assert {k["bucket"] for k in background if "bucket" in k and "region_pages" not in k} == {1}
    short = _greedy_answer(engine, prompt=PROMPT)
    assert compiles == []
    assert short[0] == covering[0]
    np.testing.assert_allclose(short[1], covering[1], rtol=0, atol=1e-5)


def test_full_mode_s_short_prompts_take_a_covering_token_bucket_until_theirs_compiles(
        tmp_path, monkeypatch, request):
    """Full KV prefills whole rows padded to flat-token buckets; warm-up compiles the largest
    and the first of `SHORT_TURN_TOKENS` tokens before the engine is ready and the others in
    the background. Until a bucket is compiled, its calls run padded to the next compiled one
    (nothing compiles on the serving thread); after, at their own size, with the same tokens
    and log-probabilities."""
    import numpy as np

    from tangram_jax.engine import step_compiler
    monkeypatch.setattr(step_compiler, "SHORT_TURN_TOKENS", 128)
    folder = build_tiny_model(tmp_path / "tiny")
    gate = _hold_background_compiles(monkeypatch, request)
    engine = Engine(tiny_engine_config(folder, "full", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(2,),
                                       max_model_len=512, max_num_batched_tokens=256))
    runner = engine.runner
    buckets = runner.prefill_token_buckets(1)
    assert buckets == [64, 128, 256], buckets
    assert [runner._token_bucket(1, n) for n in (1, 128, 129)] == [128, 128, 256]
    engine.warmup(logprobs=True)
    compiles = compiles_on_this_thread()
    prompt = dict(prompt_token_ids=list(range(5, 25)))
    covering = _greedy_answer(engine, **prompt)
    gate.set()
    assert engine.wait_for_compiles(120)
    assert [runner._token_bucket(1, n) for n in (1, 20, 129)] == [buckets[0], buckets[0], 256]
    own = _greedy_answer(engine, **prompt)
    assert compiles == []
    assert own[0] == covering[0]
    np.testing.assert_allclose(own[1], covering[1], rtol=0, atol=1e-5)


def test_a_background_program_is_held_to_the_room_the_pool_left(tmp_path, monkeypatch, request):
    """A program compiled in the background may need more than the program it stands in for
    (8B: a narrower prefill 512 bytes more), as long as it fits the room the engine left
    beside the pool (`step_peak_budget`); one that does not fit is refused and its calls keep
    the covering program, while the values whose programs fit are served by their own."""
    from tangram_jax.engine import step_compiler

    folder = build_tiny_model(tmp_path / "tiny")
    gate = _hold_background_compiles(monkeypatch, request)
    engine = Engine(tiny_engine_config(folder, "tangram", warmup=True, compile_cache_dir="off",
                                       max_num_seqs=2, decode_buckets=(1, 2),
                                       max_model_len=512, page_size=4))
    runner = engine.runner
    assert runner._ready_decode_bucket(1) == 2
    widths = {value for field, value in runner._covered_by if field == "region_pages"}
    assert widths and not any(runner._ready("region_pages", w) for w in widths)
    warm = {id(c) for c in runner._compiled.values()}
    judging = []
    judge = step_compiler.StepCompilation._judge

    def judge_noting_the_program(self, judged):
        judging.append(judged.program)
        return judge(self, judged)

    # Every program compiled after warm-up needs 512 bytes more than any warm-up program:
    # exactly the room left; the narrow decode program one byte more.
    monkeypatch.setattr(step_compiler.StepCompilation, "_judge", judge_noting_the_program)
    monkeypatch.setattr(step_compiler, "step_peak_bytes", lambda compiled: 1000 + (
        0 if id(compiled) in warm else 512 + (judging[-1].name == "decode")))
    runner.step_peak_budget = 1000 + 512
    gate.set()
    assert not engine.wait_for_compiles(120)   # one was refused
    assert runner._ready_decode_bucket(1) == 2   # the refused decode program's calls
    assert all(runner._ready("region_pages", w) for w in widths)   # fitted exactly
