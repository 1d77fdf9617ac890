"""Several processes through JAX's distributed runtime (`LLM` with `distributed_coordinator`).

Two processes on localhost, each with one CPU device, start `jax.distributed` from the config's
fields (a free port), run the same `LLM.generate` batch (SPMD) and must both return the whole
batch, in input order, equal to a third process that runs it alone (greedy tokens and
logprobs); each process must have served part of it. The same processes continue two
conversations (each session on one process), check that a replica failing on one process
raises on both, and that tensor parallelism wider than a process's devices is refused naming
the setting.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_engine import build_tiny_model, child_xla_flags

TESTS = Path(__file__).resolve().parents[1]   # where tiny_engine.py is
TIMEOUT_S = 240

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from tiny_engine import tiny_engine_config
from tangram_jax import LLM, SamplingParams

folder, port, pid = sys.argv[1], sys.argv[3], sys.argv[4]
fields = {} if pid == "alone" else dict(distributed_coordinator=f"127.0.0.1:{port}",
                                        num_processes=2, process_id=int(pid))
llm = LLM(config=tiny_engine_config(folder, "tangram", **fields))
import jax
served = []
run = llm._run
llm._run = lambda requests, use_tqdm: served.append(len(requests)) or run(requests, use_tqdm)
scored = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
prompts = ["the quick brown fox", "pack my box with five dozen liquor jugs", "hello",
           "sphinx of black quartz, judge my vow", "a", "lorem ipsum dolor sit amet, consectetur"]
outs = llm.generate(prompts, scored, use_tqdm=False)
report = dict(
    processes=jax.process_count(), index=jax.process_index(),
    local_devices=len(jax.local_devices()), served=served,
    prompts=[o.prompt for o in outs],
    tokens=[o.outputs[0].token_ids for o in outs],
    logprobs=[[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
              for o in outs])
try:
    LLM(config=tiny_engine_config(folder, "full", tensor_parallel_size=2))
    report["tp_error"] = None
except ValueError as e:
    report["tp_error"] = str(e)
# Sessions: two conversations, two turns (the model answers in lowercase letters, which
# re-tokenise to the same ids, so the second turn can continue the cached history).
chat = llm
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
convs = [[{"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "What is two plus two?"}]]
first = chat.chat(convs, greedy, use_tqdm=False)
convs = [c + [{"role": "assistant", "content": o.outputs[0].text},
              {"role": "user", "content": "And then?"}] for c, o in zip(convs, first)]
second = chat.chat(convs, greedy, use_tqdm=False)
report["chat"] = dict(
    texts=[o.outputs[0].text for o in first + second],
    sessions=[o.session_id for o in first], same_sessions=[o.session_id for o in second] ==
    [o.session_id for o in first], continued=[o.num_cached_tokens for o in second],
    held_here=[chat.engine.has_session(o.session_id) for o in first])
for o in first:
    chat.end_session(o.session_id)   # every process; the holder ends it
report["chat"]["ended"] = [chat.engine.has_session(o.session_id) for o in first]
try:
    chat.end_session("no-such-session")
    report["chat"]["unknown"] = None
except (KeyError, ValueError) as e:
    report["chat"]["unknown"] = str(e)
# A replica that fails on one process: every process raises, and the LLM stays usable.
if pid != "alone":
    if pid == "1":
        def broken():
            raise RuntimeError("replica broke")
        llm.engine.step = broken
    try:
        llm.generate(prompts, scored, use_tqdm=False)
        report["failure"] = None
    except RuntimeError as e:
        report["failure"] = str(e)
    if pid == "1":
        del llm.engine.step
    report["after_failure"] = [o.outputs[0].token_ids
                               for o in llm.generate(prompts, scored, use_tqdm=False)]
print("REPORT " + json.dumps(report), flush=True)
"""


def _letters_only(folder: Path) -> Path:
    """The tiny model made to answer in lowercase ASCII letters (so an answer's text re-tokenises
    to its token ids and a second turn finds its session): the tied embedding rows of 'a'..'z'
    scaled up, every other row scaled down, so greedy picks a letter."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    letters = np.zeros(len(embed), bool)
    letters[ord("a"):ord("z") + 1] = True
    embed[letters] *= 10.0
    embed[~letters] *= 0.01
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = _letters_only(build_tiny_model(tmp_path_factory.mktemp("tiny_mh")))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(None))   # one device each
    port = str(_free_port())
    procs = {who: subprocess.Popen([sys.executable, "-c", CHILD, str(folder), str(TESTS), port,
                                    who], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
             for who in ("0", "1", "alone")}
    results = {}
    try:
        for who, proc in procs.items():
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results[who] = (proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            proc.kill()
        tails = {w: p.communicate()[1][-2000:] for w, p in procs.items()}
        pytest.fail(f"processes still running after {TIMEOUT_S} s; stderr tails: {tails}")
    failed = {w: err[-3000:] for w, (rc, _, err) in results.items() if rc != 0}
    assert not failed, f"processes failed: {failed}"
    reports = {}
    for who, (_, out, _) in results.items():
        line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
        reports[who] = json.loads(line[len("REPORT "):])
    return reports


def test_both_processes_return_the_whole_batch_of_one(reports):
    alone, first, second = reports["alone"], reports["0"], reports["1"]
    assert (first["processes"], first["index"], second["index"]) == (2, 0, 1)
    assert first["local_devices"] == second["local_devices"] == 1
    assert alone["processes"] == 1
    for r in (first, second):
        assert r["prompts"] == alone["prompts"]       # the whole batch, in input order
        assert r["tokens"] == alone["tokens"]         # greedy tokens of one process
        for got, want in zip(r["logprobs"], alone["logprobs"]):
            assert got == pytest.approx(want, abs=1e-4)
    assert first["logprobs"] == second["logprobs"]   # the same gathered outputs
    # The batch was split: each process ran its share (by tokens), together all of it.
    assert first["served"][0] > 0 and second["served"][0] > 0
    assert first["served"][0] + second["served"][0] == len(alone["tokens"])


def test_a_conversation_stays_on_the_process_that_holds_it(reports):
    alone, first, second = (reports[w]["chat"] for w in ("alone", "0", "1"))
    assert first["texts"] == second["texts"] == alone["texts"]   # both turns, both processes
    assert first["sessions"] == second["sessions"]               # one id per session, everywhere
    assert len(set(first["sessions"])) == 2
    # Each session lives on exactly one process, one on each (the batch is split by tokens).
    assert [a != b for a, b in zip(first["held_here"], second["held_here"])] == [True, True]
    assert sorted(first["held_here"]) == [False, True]
    assert first["same_sessions"] and second["same_sessions"]    # the second turn continued them
    assert all(n > 0 for n in first["continued"]), first         # on the cached history
    assert first["continued"] == alone["continued"]
    assert first["ended"] == second["ended"] == [False, False]   # end_session on every process
    for r in (first, second, alone):                             # an unknown id: one error
        assert r["unknown"] is not None and "no-such-session" in r["unknown"], r


def test_a_failure_on_one_process_is_raised_on_every_process(reports):
    assert reports["1"]["failure"] == "replica broke", reports["1"]["failure"]
    assert reports["0"]["failure"] == ("a batch failed on another process: process 1: "
                                       "RuntimeError: replica broke"), reports["0"]["failure"]
    for who in ("0", "1"):   # both still serve the next batch
        assert reports[who]["after_failure"] == reports["alone"]["tokens"]


def test_tensor_parallelism_across_hosts_is_refused(reports):
    for who in ("0", "1"):
        msg = reports[who]["tp_error"]
        assert msg is not None and "tensor_parallel_size 2" in msg and "across hosts" in msg, msg


def test_distributed_fields_are_checked(tmp_path):
    from tangram_jax.engine.config import EngineConfig, EngineConfigError
    from tangram_jax.engine.distributed import start
    with pytest.raises(EngineConfigError, match="distributed_coordinator must be 'host:port'"):
        EngineConfig(distributed_coordinator="localhost")
    with pytest.raises(EngineConfigError, match="process_id must lie in"):
        start(EngineConfig(num_processes=2, process_id=2))
    with pytest.raises(EngineConfigError, match="num_processes must be an int >= 1"):
        EngineConfig(num_processes=0)
