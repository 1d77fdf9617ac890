"""Data-parallel replicas (`LLM(..., data_parallel_size=N)`) on several CPU devices.

JAX fixes its device count when it starts and the suite runs with one CPU device (conftest), so
the replicas run in a fresh process with ``--xla_force_host_platform_device_count=2``; that
process compares tangram's greedy outputs with two replicas against one (full mode serves the
embedded model's sessions), and checks where the arrays and the sessions live.
"""

import pytest

from tiny_engine import build_tiny_model, report_of_child

CHILD = r"""
import json, sys
import jax
sys.path.insert(0, sys.argv[2])
from tiny_engine import tiny_engine_config
from tangram_jax import LLM, SamplingParams

folder = sys.argv[1]
assert len(jax.devices()) == 2, jax.devices()
report = {}
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = ["the quick brown fox", "pack my box with five dozen liquor jugs", "hello",
           "sphinx of black quartz, judge my vow", "a", "lorem ipsum dolor sit amet, consectetur"]
for mode in ("tangram",):   # replicas are whole engines: full serves the chat below
    one = LLM(config=tiny_engine_config(folder, mode))
    two = LLM(config=tiny_engine_config(folder, mode, data_parallel_size=2))
    a = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
    devices = [sorted(str(d) for d in e.runner.k_pages.devices()) for e in two.engines]
    report[mode] = dict(equal=a == b, devices=devices)
# Sessions on the embedded SmolLM2 (its replies re-tokenise to the same ids, so a second turn can
# continue the cached history; the tiny model's random bytes often do not): two conversations,
# two turns each, on two replicas.
chat = LLM(mode="full", data_parallel_size=2, max_num_seqs=4, kv_cache_tokens=4096,
           max_model_len=1024)
convs = [[{"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "What is two plus two?"}]]
first = chat.chat(convs, greedy, use_tqdm=False)
homes = {o.session_id: next(r for r, e in enumerate(chat.engines) if e.has_session(o.session_id))
         for o in first}
convs = [c + [{"role": "assistant", "content": o.outputs[0].text},
              {"role": "user", "content": "And then?"}] for c, o in zip(convs, first)]
second = chat.chat(convs, greedy, use_tqdm=False)
report["chat"] = dict(
    homes=sorted(homes.values()), continued=[o.num_cached_tokens for o in second],
    same_sessions=[o.session_id for o in second] == [o.session_id for o in first],
    held_by_home=[chat.engines[r].has_session(s) and not chat.engines[1 - r].has_session(s)
                  for s, r in homes.items()])
try:
    LLM(config=tiny_engine_config(folder, "full", data_parallel_size=3))
    report["too_many"] = None
except ValueError as e:
    report["too_many"] = str(e)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return report_of_child(CHILD, build_tiny_model(tmp_path_factory.mktemp("tiny_dp")))


def test_two_replicas_give_the_outputs_of_one(report):
    r = report["tangram"]
    assert r["equal"], r
    # Each replica's pool lives on its own device.
    assert all(len(d) == 1 for d in r["devices"]) and len({d[0] for d in r["devices"]}) == 2, r


def test_a_conversation_stays_on_its_replica(report):
    r = report["chat"]
    assert r["homes"] == [0, 1], r              # new sessions spread over the replicas
    assert all(r["held_by_home"]), r            # each session is held by its replica alone
    assert r["same_sessions"], r                # the second turn continued the same sessions
    assert all(n > 0 for n in r["continued"]), r   # the second turn reused the cached history


def test_more_replicas_than_devices_is_one_clear_error(report):
    msg = report["too_many"]
    assert msg is not None and "data_parallel_size" in msg and "3" in msg and "2" in msg, msg


def test_an_engine_is_one_replica(tmp_path):
    from tangram_jax.engine.config import EngineConfigError
    from tangram_jax.engine.llm_engine import Engine
    from tiny_engine import tiny_engine_config
    with pytest.raises(EngineConfigError, match="data_parallel_size must be 1 for an Engine"):
        Engine(tiny_engine_config(tmp_path, "full", data_parallel_size=2))
