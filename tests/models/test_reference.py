"""Dense reference generation against transformers' greedy `generate`, batching, stops, errors."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tangram_jax.models.hf_loader import load_hf_folder
from tangram_jax.reference import generate_dense
from tangram_jax.sampling import SamplingParams
from test_decoder import FAMILIES, build_tiny_hf_model

PROMPTS = [[5, 17, 99], [3, 64, 8, 21, 90, 11, 42], [7, 1, 120, 33, 54, 2, 76, 18, 9, 100, 61, 27]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_hf_model(request.param, folder)
    config, model = load_hf_folder(folder, jnp.float32)
    return request.param, hf_model, config, model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_errors")
    build_tiny_hf_model("llama", folder)
    return load_hf_folder(folder)


def hf_greedy(hf_model, prompt, max_new_tokens, eos_token_id):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_and_batching(tiny):
    family, hf_model, config, model = tiny
    singles = [generate_dense(model, config, [p], GREEDY)[0] for p in PROMPTS]
    for prompt, ours in zip(PROMPTS, singles):
        assert ours == hf_greedy(hf_model, prompt, 8, list(config.eos_token_ids)), (family, prompt)
    assert generate_dense(model, config, PROMPTS, GREEDY) == singles
    # Another order of the same prompts: each row still gets its own answer.
    assert generate_dense(model, config, PROMPTS[::-1], GREEDY) == singles[::-1]


def test_eos_and_stop_token_ids_end_a_row(tiny):
    _, _, config, model = tiny
    free = generate_dense(model, config, PROMPTS, GREEDY, eos_token_ids=())
    assert [len(x) for x in free] == [8, 8, 8]
    # Make row 0's 3rd token its EOS: it stops there (the stop token is kept), the others go on.
    eos = [free[0][2]]
    out = generate_dense(model, config, PROMPTS, GREEDY, eos_token_ids=eos)
    first = free[0].index(eos[0])
    assert out[0] == free[0][: first + 1]
    for row in (1, 2):
        cut = free[row].index(eos[0]) + 1 if eos[0] in free[row] else 8
        assert out[row] == free[row][:cut]
    params = [dataclasses.replace(GREEDY, stop_token_ids=[free[b][4]]) for b in range(3)]
    out = generate_dense(model, config, PROMPTS, params, eos_token_ids=())
    assert [x[-1] for x in out] == [free[b][4] for b in range(3)] and all(len(x) <= 5 for x in out)
    ignoring = dataclasses.replace(GREEDY, ignore_eos=True)
    assert generate_dense(model, config, PROMPTS, ignoring, eos_token_ids=eos) == free


def test_on_token_ends_rows_early(tiny):
    _, _, config, model = tiny
    seen = []

    def stop_after_two(row, token):
        seen.append((row, token))
        return sum(r == row for r, _ in seen) == 2

    out = generate_dense(model, config, PROMPTS, GREEDY, eos_token_ids=(), on_token=stop_after_two)
    assert [len(x) for x in out] == [2, 2, 2] and len(seen) == 6


def test_seeded_sampling_is_per_row(tiny):
    family, _, config, peaked = tiny
    # The tiny tied models are very peaked (they like repeating the last token), more than the
    # largest temperature (2) flattens: a copy whose final norm scales the logits by 1/50.
    model = nnx.clone(peaked)
    model.norm.weight[...] = model.norm.weight[...] / 50
    sampled = [SamplingParams(temperature=2.0, top_k=50, top_p=0.95, max_tokens=8, seed=s)
               for s in (11, 12, 13)]
    together = generate_dense(model, config, PROMPTS, sampled, eos_token_ids=())
    alone = [generate_dense(model, config, [p], [s], eos_token_ids=())[0] for p, s in zip(PROMPTS, sampled)]
    assert together == alone  # a seeded row draws the same tokens whatever else is in its batch
    greedy = generate_dense(model, config, PROMPTS, GREEDY, eos_token_ids=())
    assert together != greedy, family  # near-uniform over 50 tokens: not argmax


def test_generation_stops_at_the_context_end(tiny_llama):
    config, model = tiny_llama
    prompt = list(np.arange(config.max_position_embeddings - 2) % config.vocab_size)
    out = generate_dense(model, config, [prompt, PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5),
                         eos_token_ids=())
    assert [len(x) for x in out] == [2, 5]


def test_bad_generation_input(tiny_llama):
    config, model = tiny_llama
    too_long = [1] * config.max_position_embeddings
    with pytest.raises(ValueError, match=r"prompt 1 has 64 tokens; the model's context is 64"):
        generate_dense(model, config, [[1, 2], too_long], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=-1)
    # Parameters are validated once and immutable afterwards: nothing invalid can reach here.
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams(temperature=0.0).max_tokens = -3
    with pytest.raises(ValueError, match=r"token ids outside \[0, 128\)"):
        generate_dense(model, config, [[1, 128]], GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        generate_dense(model, config, [[]], GREEDY)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        generate_dense(model, config, [[1]], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="list of token-id lists"):
        generate_dense(model, config, "hello", GREEDY)
