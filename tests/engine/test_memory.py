"""GPU memory sizing (arithmetic with made-up numbers), the allocator setup, the compile cache
folder, and the compiled steps' in-place pool (HLO aliasing and temp bytes, on the CPU)."""

import gc
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tangram_jax.engine import compile_cache, memory
from tangram_jax.engine.config import EngineConfig
from tangram_jax.engine.model_runner import ModelRunner, RunnerConfig
from tangram_jax.models.decoder import Decoder
from tangram_jax.scheduler.kv_cache_manager import KVCacheManager
from test_runner import CONFIG, LAYOUT

GIB = memory.GIB
PAGE = 64 * 1024       # an 8B full-KV page: 2 x 8 heads x 16 tokens x 128 x 2 bytes


def fake(limit_gib, in_use_gib, fraction):
    return memory.DeviceMemory(int(limit_gib * GIB), int(in_use_gib * GIB), 0, fraction)


def test_pool_gets_what_utilization_leaves_after_weights_step_and_headroom():
    mem = fake(72, 15, 0.9)                     # the engine set the cap: 0.9 of an 80 GiB card
    assert mem.card_bytes == 80 * GIB
    plan = memory.plan_pool(mem, 0.9, int(1.25 * GIB), memory.TieredPool.single(PAGE, 10),
                            headroom_bytes=GIB // 2)
    assert plan.budget_bytes == 72 * GIB and plan.capped_by == "utilization"
    assert plan.num_pages == int((72 - 15 - 1.25 - 0.5) * GIB) // PAGE
    assert plan.pool_bytes <= plan.budget_bytes - plan.in_use_bytes - plan.step_peak_bytes


def test_lower_allocator_cap_than_asked_bounds_the_budget():
    mem = fake(60, 15, 0.75)                    # JAX's default cap was in force: 0.75 of 80
    plan = memory.plan_pool(mem, 0.9, GIB, memory.TieredPool.single(PAGE, 10), headroom_bytes=0)
    assert plan.capped_by == "allocator" and plan.budget_bytes == 60 * GIB
    assert plan.num_pages == 44 * GIB // PAGE
    # Asking less than the cap: the utilization binds.
    plan = memory.plan_pool(mem, 0.5, GIB, memory.TieredPool.single(PAGE, 10), headroom_bytes=0)
    assert plan.capped_by == "utilization" and plan.budget_bytes == 40 * GIB


def test_provisional_size_is_kept_only_when_it_fits():
    mem = fake(72, 15, 0.9)
    fits = memory.plan_pool(mem, 0.9, GIB, memory.TieredPool.single(PAGE, 10), prefer_pages=1000)
    assert fits.num_pages == 1000
    too_big = 72 * GIB // PAGE
    plan = memory.plan_pool(mem, 0.9, GIB, memory.TieredPool.single(PAGE, 10), prefer_pages=too_big)
    assert plan.num_pages < too_big and plan.num_pages == (
        72 * GIB - 15 * GIB - GIB - memory.default_headroom(72 * GIB)) // PAGE
    # The room the steps have beside the pool (what background compiles are held to): the
    # peak and what the page rounding left where the pool was shrunk to fit, all the spare
    # budget where the smaller provisional pool was kept.
    assert GIB <= plan.step_room_bytes < GIB + PAGE
    assert fits.step_room_bytes == (72 * GIB - 15 * GIB - 1000 * PAGE
                                    - memory.default_headroom(72 * GIB))


def test_no_room_for_the_pool_is_one_clear_error():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.18 .*14.00 GiB in use.*"
                                         r"kv_cache_tokens / num_pages"):
        memory.plan_pool(fake(72, 14, 0.9), 0.18, GIB, memory.TieredPool.single(PAGE, 10))


def test_step_reserve_is_a_32nd_of_the_budget_at_least_a_gib_or_an_8th():
    assert memory.step_reserve(64 * GIB) == 2 * GIB
    assert memory.step_reserve(16 * GIB) == GIB
    assert memory.step_reserve(GIB) == GIB // 8


@pytest.fixture
def fresh_allocator_setup(monkeypatch):
    monkeypatch.setattr(memory, "_SETUP", None)
    monkeypatch.delenv(memory.FRACTION_ENV, raising=False)
    return monkeypatch


def test_allocator_fraction_is_set_before_the_backend_starts(fresh_allocator_setup):
    fresh_allocator_setup.setattr(memory, "backends_started", lambda: False)
    setup = memory.configure_allocator(0.9)
    assert setup.set_by_engine and not setup.too_late and setup.fraction == 0.9
    assert os.environ[memory.FRACTION_ENV] == "0.9"


def test_users_own_fraction_wins(fresh_allocator_setup):
    fresh_allocator_setup.setattr(memory, "backends_started", lambda: False)
    fresh_allocator_setup.setenv(memory.FRACTION_ENV, "0.8")
    setup = memory.configure_allocator(0.9)
    assert not setup.set_by_engine and setup.fraction == 0.8
    assert os.environ[memory.FRACTION_ENV] == "0.8"


def test_too_late_is_detected_and_explained(fresh_allocator_setup):
    fresh_allocator_setup.setattr(memory, "backends_started", lambda: True)
    setup = memory.configure_allocator(0.9)
    assert setup.too_late and setup.fraction == memory.JAX_DEFAULT_FRACTION
    assert "before the Engine" in setup.note and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in setup.note
    assert memory.FRACTION_ENV not in os.environ


def test_cpu_reports_no_allocator_cap_so_the_pool_stays_from_kv_cache_tokens():
    import jax
    assert memory.DeviceMemory.read(jax.devices()[0], 0.9) is None


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9"])
def test_bad_gpu_memory_utilization_is_refused(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)


def test_bad_compile_cache_dir_is_refused():
    with pytest.raises(ValueError, match="compile_cache_dir"):
        EngineConfig(compile_cache_dir=3)


def test_compile_cache_folder_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    assert compile_cache.resolve_cache_dir(None) == compile_cache.DEFAULT_CACHE_DIR.expanduser()
    assert compile_cache.resolve_cache_dir("off") is None
    assert compile_cache.resolve_cache_dir("") is None
    assert compile_cache.resolve_cache_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir(None) == tmp_path / "env"
    monkeypatch.setenv(compile_cache.CACHE_ENV, "off")
    assert compile_cache.resolve_cache_dir(None) is None


# ----- the pool is updated in place: compiled HLO of the steps ---------------------------------
POOL_PAGES = 20000     # 2.56 MB a pool array, far above any activation of the tiny model


def pool_param_aliases(hlo: str) -> set[int]:
    """Parameter numbers the compiled module aliases to an output."""
    header = next(line for line in hlo.splitlines() if "input_output_alias" in line)
    return {int(p) for p in re.findall(r"\{\d*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}


def pool_parameters(hlo: str, shape: str) -> set[int]:
    entry = hlo[hlo.index("ENTRY"):]
    return {int(m) for m in re.findall(re.escape(shape) + r"\{[0-9,]*\} parameter\((\d+)\)",
                                       entry)}


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled", "switch"])
def test_compiled_steps_keep_the_pool_in_place(layer_loop):
    manager = KVCacheManager(LAYOUT, 64, 2, 16, model_kv_shape=(3, 2, 8))
    model = Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, CONFIG, LAYOUT, None, manager.block_tables.shape,
                         runner_config=RunnerConfig(layer_loop=layer_loop))
    assert runner.k_pages is None                       # nothing allocated before sizing
    steps = runner.compile_steps(POOL_PAGES, decode_bucket=2, prefill_rows=1)
    pool_array = POOL_PAGES * int(np.prod(runner.pool_shape(1))) * 4
    shape = "f32[%d,%d,%d,%d]" % runner.pool_shape(POOL_PAGES)
    # The CPU prefill plans its writes and only reads the pool; a second program scatters them.
    # A mixed step (prefill call + decode rows, one program) writes the decode tokens in place.
    assert runner.plans_prefill_writes and set(steps) == {"decode", "prefill", "prefill_writes",
                                                          "mixed"}
    for name, compiled in steps.items():
        hlo = compiled.as_text()
        params = pool_parameters(hlo, shape)
        assert len(params) == 2, (name, params)        # k_pages and v_pages
        if name == "prefill":                          # read, never written nor copied
            assert compiled.memory_analysis().alias_size_in_bytes == 0
        else:                                          # both donated and aliased to outputs
            assert params <= pool_param_aliases(hlo), name
            assert compiled.memory_analysis().alias_size_in_bytes >= 2 * pool_array
        # No copy of a pool array in any step (the prefill's temp is its history gathers).
        bound = pool_array / 4 if name in ("prefill", "mixed") else pool_array / 20
        assert compiled.memory_analysis().temp_size_in_bytes < bound, name
        assert memory.step_peak_bytes(compiled) < bound, name


def test_compile_cache_stores_even_quick_compiles(tmp_path):
    """In a fresh process (JAX sets its cache up once per process): the engine's folder receives
    the executable of a jit that compiles in well under JAX's default 1 s threshold."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp\n"
            "from tangram_jax.engine.compile_cache import enable_compile_cache\n"
            f"assert str(enable_compile_cache({str(tmp_path)!r})) == {str(tmp_path)!r}\n"
            "jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert any(p.name.startswith("jit__lambda") for p in tmp_path.iterdir()), \
        sorted(p.name for p in tmp_path.iterdir())


def _made_up_device(monkeypatch, device: memory.DeviceMemory):
    """Engines built next load a tiny random model and see `device` as what the allocator
    reports (the CPU reports none). Returns the engine settings the tests share."""
    import tokenizers
    from tokenizers import models as tok_models

    from tangram_jax.engine import llm_engine
    from tangram_jax.models.registry import LoadedModel
    from tangram_jax.models.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tok_models.WordLevel(
        {f"t{i}": i for i in range(CONFIG.vocab_size)}, unk_token="t0"))
    # A fresh model each time: an engine's runner takes its model's layers over.
    monkeypatch.setattr(llm_engine, "load_model", lambda *args, **kwargs: LoadedModel(
        CONFIG, Decoder(CONFIG, jnp.float32, rngs=nnx.Rngs(0)),
        Tokenizer(backend, eos_token_ids=(0,)), "tiny", None))
    monkeypatch.setattr(llm_engine, "open_model", lambda *args, **kwargs: None)
    monkeypatch.setattr(memory.DeviceMemory, "read", classmethod(lambda cls, d, f: device))
    return dict(mode="full", max_num_seqs=2, max_model_len=128, chunk_size=16, page_size=4,
                max_num_batched_tokens=32, compile_cache_dir="off", warmup=False)


def test_engine_sizes_its_pool_from_what_the_device_reports(monkeypatch):
    """The sizing hook end to end on a tiny model, with a made-up device (the CPU reports no
    allocator): budget, weights, compiled step peak and headroom decide the pool, the manager
    gets the same pages, and a request is served from it."""
    from tangram_jax.engine import llm_engine
    from tangram_jax.sampling import SamplingParams

    card, in_use = 1200 * 2**20, 50 * 2**20
    device = memory.DeviceMemory(int(0.9 * card), in_use, 0, 0.9)
    small = _made_up_device(monkeypatch, device)
    engine = llm_engine.Engine(EngineConfig(**small, gpu_memory_utilization=0.5))
    plan = engine.memory_plan
    page_bytes = engine.runner.kv_bytes_per_page
    assert plan.budget_bytes == int(0.5 * card) and plan.capped_by == "utilization"
    assert plan.in_use_bytes == in_use and plan.step_peak_bytes > 0
    assert plan.headroom_bytes == plan.budget_bytes // 16
    # The provisional pool (compiled with `step_reserve` left free) is kept when the measured
    # peak fits beside it; otherwise the pool shrinks to what fits.
    fits = (plan.budget_bytes - in_use - plan.step_peak_bytes - plan.headroom_bytes) \
        // page_bytes
    provisional = (plan.budget_bytes - in_use - memory.step_reserve(plan.budget_bytes)) \
        // page_bytes
    assert plan.num_pages == (provisional if provisional <= fits else fits)
    assert plan.pool_bytes + in_use + plan.step_peak_bytes + plan.headroom_bytes \
        <= plan.budget_bytes
    assert engine.runner.k_pages.shape[0] == engine.manager.pool.num_pages == plan.num_pages
    pool = engine.kv_usage()["pool"]
    assert pool["sized_by"] == "gpu_memory_utilization" and pool["plan"]["num_pages"] == \
        plan.num_pages
    engine.add_request("a", prompt_token_ids=list(range(1, 30)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("mode", ["full", "tangram"])
def test_with_warm_up_the_pool_is_sized_from_every_program_compiled_once(monkeypatch, mode):
    """With warm-up on, the build compiles every program warm-up needs for the provisional
    pool, all at once (`ModelRunner.precompile`), and sizes the pool from their peak (the host
    tier's copies left out: a whole block table's gather would dwarf every step); when that
    size is kept, warm-up lowers and compiles nothing again and serving compiles nothing."""
    import jax

    from tangram_jax.engine import llm_engine
    from tangram_jax.sampling import SamplingParams

    card, in_use = 1200 * 2**20, 50 * 2**20
    device = memory.DeviceMemory(int(0.9 * card), in_use, 0, 0.9)
    small = dict(_made_up_device(monkeypatch, device), warmup=True, mode=mode)
    if mode == "tangram":   # the tiny random model has no shipped profile
        from tangram_jax.benchmarking.workload import skewed_profile
        small.update(group_size=1, profile=skewed_profile(CONFIG, 1, 0.5))
    engine = llm_engine.Engine(EngineConfig(**small, gpu_memory_utilization=0.5))
    plan = engine.memory_plan
    provisional = (plan.budget_bytes - in_use - memory.step_reserve(plan.budget_bytes)) \
        // engine.runner.kv_bytes_per_page
    assert plan.num_pages == provisional   # kept: the peak fits in the reserve
    # Background compiles are held to the room the kept pool left, not to the largest
    # warm-up program's peak (a narrower program may need a few hundred bytes more).
    assert engine.runner.step_peak_budget == plan.step_room_bytes > plan.step_peak_bytes
    assert engine.wait_for_compiles(120)   # what warm-up left to the background thread
    log = engine.runner.compile_log
    warm_up_programs = engine.runner.warmup_programs(**engine._warmup_arguments(
        engine.host_pool.enabled, engine.manager.block_tables.shape))
    assert len(log) == len(warm_up_programs)
    assert sorted(r["phase"] for r in log) == sorted(
        "background" if p.background else "pool" for p in warm_up_programs)
    assert {"host_copy_out", "host_copy_in"} <= {r["program"] for r in log}
    assert engine.is_warm and engine.startup_report()["num_programs"] == len(log)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event
        else None)
    for prompt in (list(range(1, 30)), [5, 6]):
        engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3] and compiles == []


def test_background_compiles_done_before_the_pool_exists_are_judged_by_its_room(monkeypatch):
    """A background compile that finishes while the pool is still being sized (a cache hit
    is that fast) is judged against the room the allocated pool left, not the provisional
    room of the largest warm-up program: a program needing more than that provisional peak
    but fitting beside the pool is used (an 8B narrower prefill was refused for 512 bytes)."""
    from tangram_jax.engine import llm_engine, step_compiler
    from tangram_jax.engine.model_runner import ModelRunner

    card, in_use = 1200 * 2**20, 50 * 2**20
    extra = 32 * 2**20   # over the largest warm-up program's peak, well within the room
    device = memory.DeviceMemory(int(0.9 * card), in_use, 0, 0.9)
    small = dict(_made_up_device(monkeypatch, device), warmup=True)
    peak_of = step_compiler.step_peak_bytes
    monkeypatch.setattr(step_compiler, "step_peak_bytes", lambda c: peak_of(c) + extra)
    allocate = ModelRunner.allocate_pool
    provisional_room = []

    def allocate_after_the_background_compiles(runner, num_pages):
        # Every background compile finishes (and is held) before the pool exists.
        assert runner.wait_for_compiles(120) and runner.compiles_running() == 0
        assert runner._held_compiles
        provisional_room.append(max(memory.step_peak_bytes(c)
                                    for c in runner._compiled.values()))
        allocate(runner, num_pages)

    monkeypatch.setattr(ModelRunner, "allocate_pool", allocate_after_the_background_compiles)
    engine = llm_engine.Engine(EngineConfig(**small, gpu_memory_utilization=0.5))
    runner = engine.runner
    assert runner.step_peak_budget == engine.memory_plan.step_room_bytes
    assert runner.step_peak_budget >= provisional_room[0] + extra   # it fits the final room
    assert engine.wait_for_compiles(120) and not runner._held_compiles
    assert "background" in {r["phase"] for r in runner.compile_log}
    assert not runner._compiling   # every covered value is served by its own program


def test_a_fixed_pool_over_the_cap_is_refused_at_build_naming_what_fits(monkeypatch):
    """kv_cache_tokens / num_pages / kv_cache_memory_bytes fix the pool; where the allocator
    reports a cap (a GPU; a made-up device here) a pool that cannot fit beside the weights and
    the largest step is refused when the engine is built, in one error naming the pool, the
    weights, the step, the cap and what would fit; what it names does fit. On a GPU the same
    check reads the real allocator (`memory.check_fixed_pool_fits`)."""
    from tangram_jax.engine import llm_engine
    from tangram_jax.engine.config import EngineConfigError

    mib = 2**20
    device = memory.DeviceMemory(256 * mib, 50 * mib, 0, 0.75)   # JAX's default cap in force
    small = _made_up_device(monkeypatch, device)
    for setting, value in (("kv_cache_tokens", 1_000_000),):   # the others: the next test
        with pytest.raises(EngineConfigError) as e:
            llm_engine.Engine(EngineConfig(**small, **{setting: value}))
        message = str(e.value)
        assert "\n" not in message
        assert re.match(rf"{setting}={value} fixes a KV pool of [\d.]+ GiB, which with 0.05 GiB "
                        rf"in use \(the weights\), the largest step's [\d.]+ GiB and 0.02 GiB of "
                        rf"headroom needs [\d.]+ GiB, more than the allocator's cap in force, "
                        rf"0.25 GiB \(0.75 of the 0.33 GiB card(: JAX's GPU backend started "
                        rf"before the Engine.*?)?\); at most "
                        rf"kv_cache_memory_bytes=(\d+) fits \(num_pages=(\d+), "
                        rf"kv_cache_tokens=([\d,]+)\)", message), message
    # What the message says fits, fits, and is the pool it names in each setting; a pool
    # that fits is served as given.
    fit = {name: int(value.replace(",", "")) for name, value in
           re.findall(r"(kv_cache_memory_bytes|num_pages|kv_cache_tokens)=([\d,]+)",
                      message.split("at most ")[1])}
    engine = llm_engine.Engine(EngineConfig(**small,
                                            kv_cache_memory_bytes=fit["kv_cache_memory_bytes"]))
    pool = engine.kv_pool()
    assert pool["bytes"] == fit["kv_cache_memory_bytes"] and engine.memory_plan is None
    assert engine.runner.step_peak_budget > 0   # what the fixed pool left the steps
    assert pool["num_pages"] == fit["num_pages"]
    assert pool["full_kv_tokens"] == fit["kv_cache_tokens"]
    assert pool["bytes"] + 50 * mib <= 256 * mib


def test_fixed_pool_check_arithmetic():
    """`memory.check_fixed_pool` with made-up numbers: pool + in use + step + headroom against
    the cap; the error names each figure and the largest pool that fits, or says none does."""
    pool = memory.TieredPool.single(PAGE, 10)
    mem = fake(60, 15, 0.75)
    tokens_of = lambda pages: (pages - 1) * 16   # noqa: E731
    fits = (60 * GIB - 15 * GIB - 2 * GIB - GIB // 2) // PAGE
    # Exactly at the cap: accepted, the steps' room their peak; below it, the room grows.
    assert memory.check_fixed_pool(mem, pool, fits, 2 * GIB, setting="num_pages=1",
                                   tokens_of=tokens_of) == 2 * GIB
    assert memory.check_fixed_pool(mem, pool, fits - 3, 2 * GIB, setting="num_pages=1",
                                   tokens_of=tokens_of) == 2 * GIB + 3 * PAGE
    with pytest.raises(ValueError) as e:
        memory.check_fixed_pool(mem, pool, fits + 1, 2 * GIB, setting=f"num_pages={fits + 1}",
                                tokens_of=tokens_of, note=": a note")
    # What the error names as fitting leaves FIT_SLACK_BYTES spare (in-use memory moves).
    named = fits - memory.FIT_SLACK_BYTES // PAGE
    assert str(e.value) == (
        f"num_pages={fits + 1} fixes a KV pool of 42.50 GiB, which with 15.00 GiB in use (the "
        f"weights), the largest step's 2.00 GiB and 0.50 GiB of headroom needs 60.00 GiB, more "
        f"than the allocator's cap in force, 60.00 GiB (0.75 of the 80.00 GiB card: a note); at "
        f"most kv_cache_memory_bytes={named * PAGE} fits (num_pages={named}, kv_cache_tokens="
        f"{(named - 1) * 16:,}), or raise the cap (XLA_PYTHON_CLIENT_MEM_FRACTION, or "
        f"gpu_memory_utilization before JAX starts)")
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1 fixes .* not even the 10 "
                                         r"pages of 65536 bytes one max_model_len sequence needs"):
        memory.check_fixed_pool(fake(16, 15.6, 0.2), pool, 10, 0, setting="kv_cache_memory_bytes=1",
                                tokens_of=tokens_of)


def test_the_allocator_cap_is_set_before_a_config_first_starts_the_backend():
    """Checking a config does not start JAX's backend; resolving it asks which backend runs
    (for the token budget's default), which starts the backend and fixes its allocator cap:
    the config's gpu_memory_utilization must already be in place then (in a fresh process; a
    GPU run once got JAX's default 0.75 of an H200 this way)."""
    import subprocess
    import sys
    code = ("import os\n"
            "from jax._src import xla_bridge\n"
            "from tangram_jax.engine import config\n"
            "c = config.EngineConfig(model='smollm2', gpu_memory_utilization=0.8)\n"
            "c.check()\n"
            "assert not xla_bridge.backends_are_initialized()\n"
            "assert config._backend_kind(c.gpu_memory_utilization) == 'cpu'\n"
            "assert xla_bridge.backends_are_initialized()\n"
            "assert os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.8', os.environ\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_tiered_pool_sizing_splits_the_bytes_by_the_share():
    """A pool of two tiers (K8V4 208 B and K4V2 112 B a slot at head_dim 128, pages of 16
    slots): the largest split of usable pages (high share 0.3) whose bytes fit, its bytes at
    most what is left and one more usable page over it; a tier short of one sequence's pages is
    one clear error naming both tiers' pages."""
    page_bytes = (208 * 16, 112 * 16)

    def split(usable):
        high = min(max(round(0.3 * usable), 1), usable - 1)
        return high + 1, usable - high + 1

    pool = memory.TieredPool(page_bytes, split, (10, 10))
    mem = fake(72, 15, 0.9)
    plan = memory.plan_pool(mem, 0.9, GIB, pool, headroom_bytes=0)
    left = 72 * GIB - 15 * GIB - GIB
    high, low = plan.num_pages
    assert (high, low) == split(high + low - 2)
    assert plan.pool_bytes == high * page_bytes[0] + low * page_bytes[1] <= left
    assert pool.bytes_of(split(high + low - 1)) > left
    # Per slot: 0.3 of 208 and 0.7 of 112, below K8V4's 208.
    assert plan.pool_bytes / ((high + low - 2) * 16) == pytest.approx(0.3 * 208 + 0.7 * 112,
                                                                     rel=1e-4)
    with pytest.raises(ValueError, match=r"fits \d+ pages of 3328 bytes \+ \d+ pages of 1792 "
                                         r"bytes, fewer than the \(10, 1000000000\) needed"):
        memory.plan_pool(mem, 0.9, GIB, memory.TieredPool(page_bytes, split, (10, 10 ** 9)),
                         headroom_bytes=0)


def test_kv_savings_say_what_was_saved_and_why_nothing_was(tmp_path):
    """`Engine.describe_kv_savings` (chat's /stats, run's memory line): the saving in words,
    and when nothing was saved, why (the protected tails hold every prompt token; decode keeps
    every generated token; full mode keeps everything)."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams
    from tiny_engine import build_tiny_model, tiny_engine_config

    folder = build_tiny_model(tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def turn(engine, ids, session="s"):
        engine.add_request(prompt_token_ids=ids, sampling_params=greedy, session_id=session)
        while engine.has_unfinished_requests():
            engine.step()

    engine = Engine(tiny_engine_config(folder, "tangram", obs_window=16))
    turn(engine, list(range(10, 22)))            # 12 prompt tokens, all in the 16-token tail
    said = engine.describe_kv_savings()
    assert said.startswith("KV held") and "the same as full KV's" in said, said
    assert "nothing was compressed" in said and "a turn's last 16 tokens" in said, said
    assert "every turn so far (1, at most 12 tokens) fits in its tail" in said, said
    usage = engine.kv_usage()
    assert usage["token_breakdown"] == dict(compressible=0, protected=12, generated=24, turns=1,
                                            longest_turn=12)
    turn(engine, list(range(30, 190)))           # 160 tokens: 144 outside the tail
    said = engine.describe_kv_savings()
    held, full = engine.kv_usage()["kv_bytes_held"], engine.kv_usage()["full_kv_bytes"]
    assert held < full
    assert re.match(rf"KV held [\d.]+ MiB, {100 * (1 - held / full):.1f}% less than full KV's "
                    rf"[\d.]+ MiB for the same 220 tokens \(144 compressible prompt tokens, 28 "
                    rf"in protected turn tails, 48 generated\)", said), said
    full_mode = Engine(tiny_engine_config(folder, "full"))
    turn(full_mode, list(range(30, 190)))
    assert "full mode keeps every token" in full_mode.describe_kv_savings()


def test_weights_of_a_model_source_load_once_the_steps_are_lowered(monkeypatch):
    """A model whose config comes first (`ModelSource`) starts loading once the sizing steps
    are lowered (its loader's Python would slow the lowering beside it), and the pool's
    provisional size counted its weights before they were in: the plan reads the allocator
    with them."""
    from tangram_jax.engine import llm_engine, step_compiler
    from tangram_jax.engine.host_offload import HostKVTier
    from tangram_jax.models.registry import ModelSource

    card = 1200 * 2**20
    device = memory.DeviceMemory(int(0.9 * card), 50 * 2**20, 0, 0.9)
    small = _made_up_device(monkeypatch, device)
    events = []
    load = llm_engine.load_model
    monkeypatch.setattr(llm_engine, "open_model", lambda *args, **kwargs: ModelSource(
        "tiny", None, CONFIG, jnp.dtype(jnp.float32),
        lambda: events.append("load") or load()))
    compile_programs = step_compiler.StepCompilation.compile_programs

    def recorded(self, programs, **kwargs):
        on_lowered = kwargs.pop("on_lowered", lambda: None)
        return compile_programs(self, programs, **kwargs,
                                on_lowered=lambda: (events.append("lowered"), on_lowered()))

    monkeypatch.setattr(step_compiler.StepCompilation, "compile_programs", recorded)
    # The host tier's memory is page-locked once the engine is ready, not beside its build.
    monkeypatch.setattr(HostKVTier, "pin_host_memory",
                        lambda self, nbytes, **kwargs: events.append("pin"))
    # Python's collector: off for the build but for one collection once the steps are lowered.
    collections = []
    gc_seen = lambda phase, info: phase == "start" and collections.append(  # noqa: E731
        (info["generation"], events[:]))
    gc.callbacks.append(gc_seen)
    try:
        engine = llm_engine.Engine(EngineConfig(**small, gpu_memory_utilization=0.5))
    finally:
        gc.callbacks.remove(gc_seen)
    assert engine.load_overlapped and events[:2] == ["lowered", "load"], events
    assert events[-1] == "pin" and events.count("pin") == 1, events
    # (The collector, back on, may collect the young objects made since: generation 0.)
    assert [c for c in collections if c[0] > 0] == [(2, ["lowered", "load"])], collections
    assert all(c[1] for c in collections), "a collection ran while the steps were lowered"
    assert gc.isenabled() and engine.startup_seconds["collect"] > 0
    plan = engine.memory_plan
    provisional = (plan.budget_bytes - device.bytes_in_use - engine.runner.weight_bytes()
                   - memory.step_reserve(plan.budget_bytes)) // engine.runner.kv_bytes_per_page
    assert plan.num_pages == min(provisional, (
        plan.budget_bytes - plan.in_use_bytes - plan.step_peak_bytes - plan.headroom_bytes)
        // engine.runner.kv_bytes_per_page)
