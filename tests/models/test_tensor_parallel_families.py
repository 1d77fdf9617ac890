"""Tensor parallelism (`tensor_parallel_size=2`, two CPU devices) of the mixture-of-experts
families: the experts are sharded by expert (each device holds half of them whole), attention
by head as for every family, and the greedy tokens and log-probabilities equal the one-device
engine's and transformers'.

As in test_tensor_parallel.py the sharded engines run in a fresh process with
``--xla_force_host_platform_device_count=2`` (the suite's JAX has one CPU device).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_engine import child_xla_flags

TESTS = Path(__file__).resolve().parents[1]   # tests/: tiny_families.py

CHILD = r"""
import json, sys
import jax
import numpy as np
import torch
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/models"]   # tiny_families, test_families
from tiny_families import build_family_model
from test_families import ENGINE, hf_greedy, identity_profile, prompts
from tangram_jax import LLM, SamplingParams
from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.models.hf_loader import load_hf_folder

family, folder = sys.argv[1], sys.argv[2]
assert len(jax.devices()) == 2, jax.devices()
hf_model = build_family_model(family, folder)
config, _ = load_hf_folder(folder)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
report = dict(hf=[hf_greedy(hf_model, p, 8) for p in prompts()])
for mode in ("full", "tangram"):
    extra = {}
    if mode == "tangram":   # ratio 1, both KV heads in one group (2 devices split a group)
        p = identity_profile(config, folder)
        extra["profile"] = BudgetProfile.from_budgets(
            model=p.model, method="snapkv", rho=1.0, lambda_=2.0, mean=p.mean, std=p.std,
            budget=p.budget, group_size=2, grouping="budget")
    for tp in (1, 2):
        llm = LLM(model=folder, mode=mode, tensor_parallel_size=tp, **ENGINE, **extra)
        outs = llm.generate([dict(prompt_token_ids=q) for q in prompts()], params,
                            use_tqdm=False)
        run = dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                   logprobs=[[e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                           o.outputs[0].token_ids)]
                             for o in outs])
        if tp == 2:
            layer = llm.engine.runner.layer_states
            layer = layer[0] if isinstance(layer, list) else layer
            moe = layer["moe"]
            run["gate_up"] = [list(s.data.shape) for s in
                              moe["gate_up"].value.addressable_shards]
            run["router"] = [list(s.data.shape) for s in moe["router"].value.addressable_shards]
        report[f"{mode}-{tp}"] = run
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def report(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tp_{request.param}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(2))
    proc = subprocess.run([sys.executable, "-c", CHILD, request.param, str(folder), str(TESTS)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("mode", ["full", "tangram"])
def test_two_devices_give_transformers_tokens(report, mode):
    one, two = report[f"{mode}-1"], report[f"{mode}-2"]
    assert one["tokens"] == report["hf"] and two["tokens"] == report["hf"]
    diff = max(abs(a - b) for x, y in zip(one["logprobs"], two["logprobs"]) for a, b in zip(x, y))
    assert diff < 1e-4, diff


def test_experts_are_sharded_by_expert(report):
    # gate_up [layers?, experts, hidden, 2 I]: each device holds 4 of the 8 experts, whole.
    shards = report["full-2"]["gate_up"]
    assert len(shards) == 2 and all(s[-3:] == [4, 64, 64] for s in shards), shards
    assert all(s[-2:] == [64, 8] for s in report["full-2"]["router"])   # replicated
