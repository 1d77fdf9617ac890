"""Tensor parallelism (`tensor_parallel_size=2`) on two CPU devices against one device.

JAX fixes its device count when it starts and the suite runs with one CPU device (conftest), so
the sharded engines run in a fresh process with ``--xla_force_host_platform_device_count=2``:
per mode, the greedy tokens and the top log-probabilities of every generated token equal the
single-device engine's, the pool is split along its head axis, and the weights are column / row
parallel. The plan's pure parts (head order, divisibility) are tested here directly.
"""

import numpy as np
import pytest

from tangram_jax.engine.tensor_parallel import check_tensor_parallel, device_major_perm
from tiny_engine import build_tiny_model, report_of_child

CHILD = r"""
import json, sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[2])
from tiny_engine import tiny_engine_config, tiny_profile
from tangram_jax import LLM, SamplingParams

folder = sys.argv[1]
assert len(jax.devices()) == 2, jax.devices()
params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
prompts = ["the quick brown fox jumps over the lazy dog " * 3, "hello", "pack my box",
           "sphinx of black quartz, judge my vow, " * 4]
report = {}
for mode in ("full", "tangram", "dynamic"):
    extra = dict(profile=tiny_profile(folder, group_size=2)) if mode == "tangram" else {}
    runs = {}
    for tp in (1, 2):
        llm = LLM(config=tiny_engine_config(folder, mode, tensor_parallel_size=tp, **extra))
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[tp] = dict(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            logprobs=[[sorted(step.values(), key=lambda l: l.rank)[0].logprob
                       for step in o.outputs[0].logprobs] for o in outs],
            pool=str(getattr(llm.engine.runner.k_pages.sharding, "spec", None)),
            shard_shapes=sorted({tuple(s.data.shape)
                                 for s in llm.engine.runner.k_pages.addressable_shards}),
            devices=len(llm.engine.runner.k_pages.devices()))
        if tp == 2:
            layer = llm.engine.runner.layer_states
            layer = layer[0] if isinstance(layer, list) else layer
            runs[tp]["q_proj"] = str(layer["q_proj"]["kernel"].value.sharding.spec)
            runs[tp]["o_proj"] = str(layer["o_proj"]["kernel"].value.sharding.spec)
    report[mode] = dict(
        equal_tokens=runs[1]["tokens"] == runs[2]["tokens"],
        max_logprob_diff=float(max(abs(a - b) for x, y in zip(runs[1]["logprobs"],
                                                              runs[2]["logprobs"])
                                   for a, b in zip(x, y))),
        one=runs[1], two=runs[2])
# The GPU's layer loop (one jitted layer body called a layer) over the mesh too.
llm = LLM(config=tiny_engine_config(folder, "tangram", tensor_parallel_size=2,
                                    profile=tiny_profile(folder, group_size=2),
                                    layer_loop="unrolled"))
report["tangram_unrolled_tokens"] = [list(o.outputs[0].token_ids)
                                     for o in llm.generate(prompts, params, use_tqdm=False)]
try:
    LLM(config=tiny_engine_config(folder, "tangram", tensor_parallel_size=2,
                                  profile=tiny_profile(folder, group_size=1)))
    report["odd_groups"] = None
except ValueError as e:
    report["odd_groups"] = str(e)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return report_of_child(CHILD, build_tiny_model(tmp_path_factory.mktemp("tiny_tp")))


@pytest.mark.parametrize("mode", ["full", "tangram", "dynamic"])
def test_two_devices_give_the_outputs_of_one(report, mode):
    r = report[mode]
    assert r["equal_tokens"], (r["one"]["tokens"], r["two"]["tokens"])
    assert r["max_logprob_diff"] < 1e-4, r["max_logprob_diff"]


def test_the_unrolled_layer_loop_over_two_devices_gives_the_outputs_of_one(report):
    assert report["tangram_unrolled_tokens"] == report["tangram"]["one"]["tokens"]


@pytest.mark.parametrize("mode", ["full", "tangram", "dynamic"])
def test_pool_and_weights_are_split_over_the_devices(report, mode):
    one, two = report[mode]["one"], report[mode]["two"]
    assert one["devices"] == 1 and two["devices"] == 2
    assert "'tp'" in two["pool"], two["pool"]
    (full_shape,), (shard_shape,) = one["shard_shapes"], two["shard_shapes"]
    assert shard_shape[1] * 2 == full_shape[1] and shard_shape[0] == full_shape[0]
    # Column parallel: the output features; row parallel: the input features (after the
    # stacked layer axis of the scanned layers).
    assert two["q_proj"].endswith("'tp')") and two["o_proj"].endswith("'tp', None)"), two


def test_a_group_size_the_devices_cannot_split_is_refused(report):
    msg = report["odd_groups"]
    assert msg is not None and "tensor_parallel_size 2" in msg and "group size 1" in msg, msg


def test_device_major_head_order():
    # 2 groups of 4 heads over 2 devices: device 0 takes heads 0,1 of each group.
    perm = device_major_perm(np.array([[7, 6, 5, 4, 3, 2, 1, 0]]), group_size=4, tp=2)
    assert perm.tolist() == [[7, 6, 3, 2, 5, 4, 1, 0]]
    assert device_major_perm(np.array([[1, 0]]), 2, 1).tolist() == [[1, 0]]


def test_divisibility_is_checked_with_the_numbers():
    check_tensor_parallel(2, num_heads=32, num_kv_heads=8, group_size=8, intermediate_size=14336)
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        check_tensor_parallel(2, num_heads=9, num_kv_heads=3, group_size=3,
                              intermediate_size=1536)
