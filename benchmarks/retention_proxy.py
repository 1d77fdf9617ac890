"""Offline proxy ranking KV retention rules on the long-session tasks (pure-JAX model, no engine).

Ranks KV retention rules by accuracy, cheaply: per sample, turn 1 runs through the embedded
SmolLM2-135M once, densely; every rule then scores turn 1's tokens from that one pass and keeps,
per (layer, KV head), its count of them; and all rules' sessions are decoded together, one batch
row per (rule, budget, ratio), with attention masked to each row's kept tokens.

Per sample (``tangram_jax.evaluation.tasks.generate``; turn tokens as the harness builds them):

- turn 1 (n tokens) runs densely: K/V of every layer, the observation windows' attention (each
  128-token chunk's last 32 queries over everything before them, the turn's last 32 queries),
  the window's queries. The last ``TAIL`` = 32 tokens (question + template) are protected;
  the u = n - 32 tokens before them are what the rules choose from. Rules J/JD add a KVzip
  pass (the context repeated), the Qo rules a question-only pass (the last 32 tokens alone);
- a rule's keep mask [layers, kv_heads, u] (the rules: `_retention_rules.py`): per-chunk rules
  keep ``ceil(r * c)`` of each chunk's c unprotected tokens (`kv_layout.chunk_keep_count`),
  whole-turn rules ``ceil(r * u)`` of the turn's; r is the head's budget (a shipped G = 1
  profile, or every head r: "uniform");
- decoding: the protected tail is prefilled again attending to the kept context + itself (as
  kvpress prefills the question after compressing), then the answer is decoded greedily
  (16 tokens at most, the engine's stop rule, `sampling.StopChecker`); each follow-up turn
  (the previous answer's last token + the follow-up's tokens, all kept) is prefilled on top and
  its answer decoded. Judged by `scoring.is_correct`.

Approximation: turn 1's context K/V (and the windows' attention) come from the full,
uncompressed forward, as in kvpress; the engine's later chunks attend to compressed history.

    python3 benchmarks/retention_proxy.py --samples 40 \
        --out benchmarks/results/retention_proxy.json --overwrite
    JAX_PLATFORMS=cuda python3 benchmarks/retention_proxy.py --samples 100 --budgets profile \
        --rules A,B,C,D,E,H.25,Qo,QoH1,QoE1,QoHt,QoHq,DHg          # on a GPU
    python3 benchmarks/retention_proxy.py --print-tables benchmarks/results/retention_proxy.json

Runs on the CPU unless JAX_PLATFORMS says otherwise. Writes JSON (`--out`, default a fresh file
under benchmarks/results/runs/; after every sample; --resume continues a file): device, git
revision, command, per rule x budget x ratio x task the turn-1 and follow-up accuracy with
Wilson 95% intervals and the share of heads keeping every digit token of the asked value,
per-sample answers, and time per sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout's tangram_jax
sys.path.insert(0, str(Path(__file__).resolve().parent))       # _retention_rules

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from _retention_rules import (CHUNK, KVZIP_RULES, PROBE_RULES, QUESTION_RULES,  # noqa: E402
                              RECALL_SUFFIXES, RULES, TAIL, QuestionPass, Turn1, is_rule, keep_mask,
                              probe_scores, recall_keep, recall_rounds, rule_scores,
                              split_recall)
from tangram_jax.kv_layout import chunk_keep_count  # noqa: E402
from tangram_jax.atomic_files import write_text_atomic  # noqa: E402
from tangram_jax.benchmarking.results import (finish, provenance,  # noqa: E402
                                              resolve_outputs, start)
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.compression.profile import PROFILES_DIR, BudgetProfile  # noqa: E402
from tangram_jax.evaluation.harness import _followup_token_ids, first_turn_token_ids  # noqa: E402
from tangram_jax.evaluation.scoring import is_correct, wilson_interval  # noqa: E402
from tangram_jax.evaluation.tasks import LONG_TASKS, TaskSizes, generate  # noqa: E402
from tangram_jax.models.registry import load_model  # noqa: E402
from tangram_jax.models.rope import inverse_frequencies  # noqa: E402
from tangram_jax.sampling import SamplingParams, StopChecker  # noqa: E402

MAX_TOKENS = 16
BUCKET = 256         # turn-1 and context lengths are padded to multiples of this (few compiles)
FOLLOWUP_BUCKET = 8
NEW_SLOTS = 256      # per-row cache for the tail, answers and follow-up turns
REPEAT_PROMPT = "\n\nRepeat the previous context:\n"
# Rules P / DPg: a request for the context's facts, asked of no task in particular.
PROBE_PROMPT = ("\n\nList every name, number, code and value stated in the text above, "
                "with what each one belongs to:\n")
BUDGETS = ("profile", "uniform")
# The default rule set: the first CPU run's (results/retention_proxy.json); the KVzip (J, JD)
# and question-only (Qo...) rules and DHg on request.
DEFAULT_RULES = RULES[:RULES.index("J")]
_NEG = -1e30


def _pad_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ----- the model, split for scans over layers ----------------------------------------------

class ProxyModel:
    """The decoder as (graphdef, state) plus its layers stacked for `lax.scan`, and the four
    jitted programs of the proxy: the dense scoring pass, the KVzip pass, the question-only
    pass and the masked extend."""

    def __init__(self, loaded):
        model = loaded.model
        self.config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.q_per_kv = cfg.num_heads // cfg.num_kv_heads
        layers = list(model.layers)
        self.layer_graphdef = nnx.split(layers[0])[0]
        self.layer_states = jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *[nnx.split(layer)[1] for layer in layers])
        model.layers = nnx.List([])
        self.graphdef, self.state = nnx.split(model)
        self.dtype = model.dtype
        self.inv_freq = jnp.asarray(inverse_frequencies(cfg), jnp.float32)
        self.dense_pass = jax.jit(self._dense_pass)
        self.kvzip_pass = jax.jit(self._kvzip_pass)
        self.probe_pass = jax.jit(self._probe_pass, static_argnames=("window",))
        self.question_pass = jax.jit(self._question_pass)
        self.extend = jax.jit(self._extend, donate_argnums=(5, 6), static_argnames=("score",))

    def _layer(self, layer_state):
        return nnx.merge(self.layer_graphdef, layer_state)

    def _causal_layer(self, layer_state, h, n, first_position=0):
        """One layer of a dense causal pass over keys < n, the tokens at positions
        first_position + 0 .. N-1. h [1, N, hidden] -> (h, q [N, Hq, D], k, v [N, Hkv, D],
        probs float32 [Hq, N, N], their log-sum-exp [Hq, N])."""
        layer = self._layer(layer_state)
        t = h.shape[1]
        q, k, v = layer.qkv(h, first_position + jnp.arange(t, dtype=jnp.int32)[None])
        q, k, v = q[0], k[0], v[0]
        key = jnp.arange(t)
        mask = (key[None, :] <= key[:, None]) & (key[None, :] < n)
        logits = jnp.einsum("tgqd,sgd->gqts",
                            q.astype(jnp.float32).reshape(t, -1, self.q_per_kv, q.shape[-1]),
                            k.astype(jnp.float32)) * (q.shape[-1] ** -0.5)
        logits = jnp.where(mask, logits, _NEG)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("gqts,sgd->tgqd", probs, v.astype(jnp.float32))
        h = layer.finish(h, out.reshape(1, t, -1, q.shape[-1]).astype(h.dtype))
        return (h, q, k, v, probs.reshape(-1, t, t),
                jax.nn.logsumexp(logits, axis=-1).reshape(-1, t))

    def _dense_pass(self, state, layer_states, tokens, n):
        """tokens [N] (turn 1, padded), n: its length. Returns per layer: k, v [L, N, Hkv, D];
        chunk_obs [L, C, Hq, TAIL, CHUNK] (chunk c's last TAIL queries over the chunk's keys,
        normalised over everything before them, zero for queries before the chunk, as the
        engine's `observation_probs`); turn_obs [L, Hq, TAIL, N] (the turn's last TAIL
        queries); q_window [L, TAIL, Hq, D]; attn_turn, attn_chunk [L, Hkv, N]: per key the
        most attention (max over the KV head's query heads) any query of the context before
        the protected tail pays it, of the whole turn / of the key's own CHUNK (rules A*)."""
        model = nnx.merge(self.graphdef, state)
        t = tokens.shape[0]
        chunks = t // CHUNK
        start = jnp.arange(chunks) * CHUNK
        end = jnp.minimum(start + CHUNK, n)
        rows = end[:, None] - TAIL + jnp.arange(TAIL)[None]                     # [C, TAIL]
        row_ok = rows >= start[:, None]

        query = jnp.arange(t)
        context = query < n - TAIL                      # queries before the protected tail
        same_chunk = (query[:, None] // CHUNK) == (query[None, :] // CHUNK)   # [N, N]

        def most(probs, rows_ok):   # [Hq, N, N] -> [Hkv, N]: max over allowed queries, heads
            best = jnp.max(jnp.where(rows_ok, probs, 0.0), axis=1)
            return best.reshape(-1, self.q_per_kv, t).max(axis=1)

        def step(h, layer_state):
            h, q, k, v, probs, _ = self._causal_layer(layer_state, h, n)
            attn_turn = most(probs, context[None, :, None])
            attn_chunk = most(probs, (context[:, None] & same_chunk)[None])
            picked = probs[:, jnp.clip(rows, 0, t - 1)]                      # [Hq, C, W, N]
            picked = picked.reshape(*picked.shape[:3], chunks, CHUNK)
            own = jnp.moveaxis(jnp.diagonal(picked, axis1=1, axis2=3), -1, 0)  # [C, Hq, W, 128]
            own = jnp.where(row_ok[:, None, :, None], own, 0.0)
            turn = jax.lax.dynamic_slice_in_dim(probs, n - TAIL, TAIL, axis=1)
            q_win = jax.lax.dynamic_slice_in_dim(q, n - TAIL, TAIL, axis=0)
            return h, (k, v, own, turn, q_win, attn_turn, attn_chunk)

        h = model.embed(tokens[None])
        _, outs = jax.lax.scan(step, h, layer_states)
        return outs

    def _kvzip_pass(self, state, layer_states, tokens, n, repeat_start):
        """tokens [N2] (context, repeat prompt, context again; padded), n: the real length,
        repeat_start: the first token after the context. Returns [L, Hkv, N2]: per key the max
        attention probability over the queries at repeat_start .. n-1 and the KV head's query
        heads."""
        model = nnx.merge(self.graphdef, state)
        t = tokens.shape[0]
        query = jnp.arange(t)
        repeat = (query >= repeat_start) & (query < n)

        def step(h, layer_state):
            h, _, _, _, probs, _ = self._causal_layer(layer_state, h, n)
            best = jnp.max(jnp.where(repeat[None, :, None], probs, 0.0), axis=1)   # [Hq, N2]
            return h, best.reshape(-1, self.q_per_kv, t).max(axis=1)

        _, scores = jax.lax.scan(step, model.embed(tokens[None]), layer_states)
        return scores

    def _probe_pass(self, state, layer_states, tokens, n, *, window):
        """tokens [N2] (context then the probe's `window` tokens; padded), n: the real length.
        Returns [L, Hq, window, N2]: the probe's queries' attention probabilities (what D's
        SnapKV pools for the question)."""
        model = nnx.merge(self.graphdef, state)

        def step(h, layer_state):
            h, _, _, _, probs, _ = self._causal_layer(layer_state, h, n)
            return h, jax.lax.dynamic_slice_in_dim(probs, n - window, window, axis=1)

        _, obs = jax.lax.scan(step, model.embed(tokens[None]), layer_states)
        return obs

    def _question_pass(self, state, layer_states, tokens, first_position):
        """The question alone: tokens [W] (turn 1's last W) at positions first_position ..,
        attending only to each other. Returns q [L, W, Hq, D], the log-sum-exp of each query's
        logits over the question's keys [L, Hq, W], and k [L, W, Hkv, D]."""
        model = nnx.merge(self.graphdef, state)
        w = tokens.shape[0]

        def step(h, layer_state):
            h, q, k, _, _, lse = self._causal_layer(layer_state, h, w, first_position)
            return h, (q, lse, k)

        _, (q, lse, k) = jax.lax.scan(step, model.embed(tokens[None]), layer_states)
        return q, lse, k

    def _extend(self, state, layer_states, ctx_k, ctx_v, keep, new_k, new_v, lengths, tokens,
                num_real, base, score=False):
        """Prefill/decode `tokens` [B, T] of B sessions that share turn 1's context.

        ctx_k, ctx_v [L, U, Hkv, D]: the context's K/V (positions 0 .. U-1, from the dense
        pass); keep [L, B, Hkv, U] bool: what each row's heads may attend to of it;
        new_k, new_v [L, B, S, Hkv, D]: each row's own tokens after the context (slot s is
        position base + s), `lengths` [B] of them filled. Row b's first num_real[b] tokens are
        real; they go to slots lengths[b] ... (the rest are padding, overwritten later).
        Returns (logits [B, V] float32 after each row's last real token, new_k, new_v), and
        with `score` (static) a fourth: [L, B, Hkv, U] float32, per context key the attention
        the rows' real tokens would pay it were every context key visible (their queries are
        computed with the kept ones: an engine's first pass over a follow-up, before it
        recalls history from the host), summed over the tokens and averaged over the KV head's
        query heads: the recall rules' SnapKV score, before pooling."""
        model = nnx.merge(self.graphdef, state)
        batch, t = tokens.shape
        slots = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]         # [B, T]
        causal = jnp.arange(new_k.shape[2])[None, None, :] <= slots[:, :, None]  # [B, T, S]
        rows = jnp.arange(batch)[:, None]
        scale = self.config.head_dim ** -0.5

        def step(h, xs):
            layer_state, ck, cv, kp, nk, nv = xs
            layer = self._layer(layer_state)
            q, k, v = layer.qkv(h, base + slots)
            nk = nk.at[rows, slots].set(k.astype(nk.dtype), mode="drop")
            nv = nv.at[rows, slots].set(v.astype(nv.dtype), mode="drop")
            qg = q.astype(jnp.float32).reshape(batch, t, -1, self.q_per_kv, q.shape[-1])
            lc = jnp.einsum("btgqd,sgd->bgqts", qg, ck.astype(jnp.float32)) * scale
            lc = jnp.where(kp[:, :, None, None, :], lc, _NEG)
            ln = jnp.einsum("btgqd,bsgd->bgqts", qg, nk.astype(jnp.float32)) * scale
            ln = jnp.where(causal[:, None, None], ln, _NEG)
            p = jax.nn.softmax(jnp.concatenate([lc, ln], axis=-1), axis=-1)
            pc, pn = p[..., :ck.shape[0]], p[..., ck.shape[0]:]
            out = (jnp.einsum("bgqts,sgd->btgqd", pc, cv.astype(jnp.float32))
                   + jnp.einsum("bgqts,bsgd->btgqd", pn, nv.astype(jnp.float32)))
            h = layer.finish(h, out.reshape(batch, t, -1, q.shape[-1]).astype(h.dtype))
            if not score:
                return h, (nk, nv)
            lc_all = jnp.einsum("btgqd,sgd->bgqts", qg, ck.astype(jnp.float32)) * scale
            lc_all = jnp.where(jnp.arange(ck.shape[0]) < base, lc_all, _NEG)   # not padding
            everything = jax.nn.softmax(jnp.concatenate([lc_all, ln], axis=-1), axis=-1)
            real = jnp.arange(t)[None, :] < num_real[:, None]                       # [B, T]
            paid = jnp.where(real[:, None, None, :, None], everything[..., :ck.shape[0]], 0.0)
            return h, (nk, nv, paid.sum(axis=3).mean(axis=2))                   # [B, Hkv, U]

        h = model.embed(tokens)
        h, outs = jax.lax.scan(step, h, (layer_states, ctx_k, ctx_v, keep, new_k, new_v))
        last = h[jnp.arange(batch), jnp.maximum(num_real - 1, 0)]
        return (model.logits(last[:, None])[:, 0], *outs)


# ----- sessions ----------------------------------------------------------------------------

def run_sessions(pm: ProxyModel, sample, ids: list[int], t1: Turn1, keep: np.ndarray,
                 recall: list | None = None):
    """Greedy answers of every turn for B rows of keep masks keep [B, L, Hkv, u].
    recall: per row None, or a function (follow-up scores [L, Hkv, u], the row's keep mask
    [L, Hkv, u]) -> its new keep mask (its attribute `rounds`, default 1: how many scoring
    passes, each followed by it), applied before each follow-up turn is prefilled: the
    follow-up's tokens first run over the kept context to score all of it (`ProxyModel.
    _extend`'s `score`), as an engine holding the dropped tokens in host memory would before
    recalling some (rules X+R: `_retention_rules.recall_keep`).
    Returns per row a list of (text, token_ids) per turn."""
    tok = pm.tokenizer
    batch = keep.shape[0]
    u = t1.u
    ctx_len = _pad_to(u, BUCKET)
    ctx_k = jnp.asarray(t1.k[:, :ctx_len])
    ctx_v = jnp.asarray(t1.v[:, :ctx_len])
    if ctx_k.shape[1] < ctx_len:
        pad = ((0, 0), (0, ctx_len - ctx_k.shape[1]), (0, 0), (0, 0))
        ctx_k, ctx_v = jnp.pad(ctx_k, pad), jnp.pad(ctx_v, pad)
    kp = np.zeros((keep.shape[1], batch, keep.shape[2], ctx_len), bool)
    kp[..., :u] = np.moveaxis(keep, 0, 1)
    held = kp   # numpy, what `recall` changes
    kp = jnp.asarray(kp)
    shape = (pm.config.num_layers, batch, NEW_SLOTS, pm.config.num_kv_heads, pm.config.head_dim)
    new_k, new_v = jnp.zeros(shape, pm.dtype), jnp.zeros(shape, pm.dtype)
    lengths = np.zeros(batch, np.int32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    answers = [[] for _ in range(batch)]

    def extend(tokens: list[list[int]], active: np.ndarray, score: bool = False):
        nonlocal new_k, new_v, lengths
        width = max(len(x) for x in tokens)
        width = 1 if width == 1 else _pad_to(width, FOLLOWUP_BUCKET)
        arr = np.zeros((batch, width), np.int32)
        real = np.zeros(batch, np.int32)
        for b, x in enumerate(tokens):
            arr[b, :len(x)] = x
            real[b] = len(x) if active[b] else 0
        logits, new_k, new_v, *scores = pm.extend(
            pm.state, pm.layer_states, ctx_k, ctx_v, kp, new_k, new_v, jnp.asarray(lengths),
            jnp.asarray(arr), jnp.asarray(real), jnp.int32(u), score=score)
        if score:   # the slots written stay free: the turn's real pass writes them again
            return np.asarray(scores[0])[..., :u]   # [L, B, Hkv, u]
        lengths = lengths + real
        if lengths.max() > NEW_SLOTS:
            raise RuntimeError(f"a session outgrew its {NEW_SLOTS} new slots")
        return np.asarray(jnp.argmax(logits, axis=-1))   # greedy

    for turn in range(len(sample.turns)):
        if turn == 0:
            tokens = [list(ids[u:])] * batch
        else:   # the previous answer's last token is not in the cache yet
            tokens = [[answers[b][-1][1][-1]]
                      + _followup_token_ids(tok, sample, turn, answers[b][-1][1])
                      for b in range(batch)]
        active = np.ones(batch, bool)
        rounds = max((getattr(r, "rounds", 1) for r in recall or () if r is not None),
                     default=0)
        for done in range(rounds if turn else 0):
            scores = extend(tokens, active, score=True)
            for b, rule in enumerate(recall):
                if rule is not None and getattr(rule, "rounds", 1) > done:
                    held[:, b, :, :u] = rule(scores[:, b], held[:, b, :, :u])
            kp = jnp.asarray(held)
        checkers = [StopChecker(tok.decode, params, tok.eos_token_ids, p) for p in tokens]
        nxt = extend(tokens, active)
        while True:
            for b in np.nonzero(active)[0]:
                checkers[b].append(int(nxt[b]))
                if checkers[b].finished:
                    active[b] = False
            if not active.any():
                break
            nxt = extend([[int(x)] for x in nxt], active)
        for b in range(batch):
            answers[b].append((checkers[b].text, list(checkers[b].token_ids)))
    return answers


def digit_positions(tok, ids: list[int], u: int, answer: str) -> list[np.ndarray]:
    """Positions (< u) of every occurrence of the answer's digit tokens in turn 1."""
    want = tok.encode(answer, add_special_tokens=False)
    m = len(want)
    return [np.arange(i, i + m) for i in range(u - m + 1) if ids[i:i + m] == want]


# ----- the run -----------------------------------------------------------------------------

def row_specs(rules: list[str], ratios: list[float], budgets: list[str],
              uniform_rules: list[str]) -> list[tuple[str, str, float]]:
    """(rule, budget, ratio) of every batch row: full KV once, then each rule at each ratio
    with the profile, and the uniform control for `uniform_rules`."""
    rows = [("A", "full", 1.0)] if "A" in rules else []
    for ratio in ratios:
        for budget in budgets:
            for rule in rules:
                if rule == "A" or (budget == "uniform" and rule not in uniform_rules):
                    continue
                rows.append((rule, budget, ratio))
    return rows


def row_label(rule: str, budget: str, ratio: float) -> str:
    return "A" if rule == "A" else f"{rule}@{budget}{ratio:g}"


def turn1_pass(pm: ProxyModel, ids: list[int], question: bool = False) -> Turn1:
    """Turn 1 (`ids`, n tokens) through the dense pass, and with `question` the question-only
    pass of its last TAIL tokens: what the rules score."""
    n = len(ids)
    arr = np.zeros(_pad_to(n, BUCKET), np.int32)
    arr[:n] = ids
    dense = pm.dense_pass(pm.state, pm.layer_states, jnp.asarray(arr), jnp.int32(n))
    qp = None
    if question:
        qp = QuestionPass(*(np.asarray(x) for x in pm.question_pass(
            pm.state, pm.layer_states, jnp.asarray(ids[n - TAIL:], jnp.int32),
            jnp.int32(n - TAIL))))
    return Turn1(n, n - TAIL, *(np.asarray(x) for x in dense), question=qp)


def evaluate_sample(pm: ProxyModel, sample, rows, budgets: dict, inv_freq) -> dict:
    tok = pm.tokenizer
    ids = first_turn_token_ids(tok, sample)
    rules = sorted({split_recall(r)[0] for r, _, _ in rows if r != "A"})
    times = {}
    t0 = time.perf_counter()
    t1 = turn1_pass(pm, ids, question=bool(set(rules) & set(QUESTION_RULES)))
    n, u = t1.n, t1.u
    times["dense"] = time.perf_counter() - t0
    kvzip = None
    if set(rules) & set(KVZIP_RULES):
        t0 = time.perf_counter()
        prompt = tok.encode(REPEAT_PROMPT, add_special_tokens=False)
        seq = list(ids[:u]) + prompt + list(ids[:u])
        arr = np.zeros(_pad_to(len(seq), BUCKET), np.int32)
        arr[:len(seq)] = seq
        kvzip = np.asarray(pm.kvzip_pass(pm.state, pm.layer_states, jnp.asarray(arr),
                                         jnp.int32(len(seq)), jnp.int32(u + len(prompt))))
        times["kvzip"] = time.perf_counter() - t0
    probe = None
    if set(rules) & set(PROBE_RULES):   # the probe's queries over the context, as D's SnapKV
        t0 = time.perf_counter()
        prompt = tok.encode(PROBE_PROMPT, add_special_tokens=False)
        seq = list(ids[:u]) + prompt
        arr = np.zeros(_pad_to(len(seq), BUCKET), np.int32)
        arr[:len(seq)] = seq
        obs = pm.probe_pass(pm.state, pm.layer_states, jnp.asarray(arr), jnp.int32(len(seq)),
                            window=len(prompt))
        probe = np.asarray(probe_scores(obs, len(seq), q_per_kv=pm.q_per_kv))
        times["probe"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scored = rule_scores(t1, rules, kvzip, inv_freq, pm.q_per_kv, probe)
    masks, recall = [], []
    for rule, budget, ratio in rows:
        base, share = split_recall(rule)
        if rule == "A":
            masks.append(np.ones((pm.config.num_layers, pm.config.num_kv_heads, u), bool))
        else:
            kind, scores = scored[base]
            masks.append(keep_mask(kind, scores, t1, budgets[(budget, ratio)]))
        count = None if share is None else chunk_keep_count(budgets[(budget, ratio)], u)
        recall.append(None if share is None else functools.partial(
            recall_keep, count=count, share=share))
        if share is not None:
            recall[-1].rounds = recall_rounds(rule)
    masks = np.stack(masks)
    times["score"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    answers = run_sessions(pm, sample, ids, t1, masks, recall)
    times["decode"] = time.perf_counter() - t0
    digits = [digit_positions(tok, ids, u, t.answer) for t in sample.turns]
    record = dict(id=sample.id, task=sample.task, n_tokens=n, seconds=times, rows={})
    for (rule, budget, ratio), mask, ans in zip(rows, masks, answers):
        kept = []
        for spans in digits:   # share of heads keeping every digit of some occurrence
            if not spans:
                kept.append(None)
                continue
            whole = np.zeros(mask.shape[:2], bool)
            for pos in spans:
                whole |= mask[..., pos].all(axis=-1)
            kept.append(float(whole.mean()))
        record["rows"][row_label(rule, budget, ratio)] = dict(
            correct=[bool(is_correct(t.answer, a[0])) for t, a in zip(sample.turns, ans)],
            answers=[a[0] for a in ans], digits_kept=kept)
    return record


def _part(records: list[dict], label: str, turns: slice) -> dict:
    correct = [c for r in records for c in r["rows"][label]["correct"][turns]]
    digits = [d for r in records for d in r["rows"][label]["digits_kept"][turns] if d is not None]
    lo, hi = wilson_interval(sum(correct), len(correct))
    return dict(n=len(correct), correct=int(sum(correct)),
                accuracy=sum(correct) / len(correct) if correct else None, ci95=[lo, hi],
                digits_kept=float(np.mean(digits)) if digits else None)


def summarise(records: list[dict], rows) -> list[dict]:
    out = []
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for task in tasks:
        recs = [r for r in records if r["task"] == task]
        multi = any(len(row["correct"]) > 1 for r in recs for row in r["rows"].values())
        for rule, budget, ratio in rows:
            label = row_label(rule, budget, ratio)
            entry = dict(rule=rule, budget=budget, ratio=ratio, task=task, samples=len(recs),
                         turn1=_part(recs, label, slice(0, 1)))
            if multi:
                entry["followup"] = _part(recs, label, slice(1, None))
            out.append(entry)
    return out


def markdown_table(results: list[dict], metric: str = "accuracy") -> str:
    """One line per rule x budget x ratio, a column per task (turn 1 / follow-ups): accuracy %
    [Wilson 95%], or (metric "digits_kept") the % of heads keeping every digit of the value
    asked."""
    cols = []
    for task in dict.fromkeys(r["task"] for r in results):
        cols.append((task, "turn1"))
        if any("followup" in r for r in results if r["task"] == task):
            cols.append((task, "followup"))
    short = {"long_facts": "facts", "long_passkey": "passkey", "long_kv": "kv"}
    head = "| rule | " + " | ".join(f"{short.get(t, t)} {'t1' if p == 'turn1' else 'f/u'}"
                                     for t, p in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    keys = list(dict.fromkeys((r["rule"], r["budget"], r["ratio"]) for r in results))
    for rule, budget, ratio in keys:
        cells = []
        for task, part in cols:
            e = next((r for r in results if (r["rule"], r["budget"], r["ratio"], r["task"])
                      == (rule, budget, ratio, task)), None)
            if e is None or part not in e:
                cells.append("")
                continue
            p = e[part]
            if metric == "accuracy":
                cells.append(f"{100 * p['accuracy']:.0f} [{100 * p['ci95'][0]:.0f}-"
                             f"{100 * p['ci95'][1]:.0f}]")
            else:
                cells.append("" if p[metric] is None else f"{100 * p[metric]:.0f}")
        name = "A full" if rule == "A" else f"{rule} {'' if budget == 'profile' else 'unif '}{ratio:g}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(doc: dict) -> str:
    """Per row and task part: accuracy minus full KV's, in points, and (turns full KV answered
    that the row did not / turns the row answered that full KV did not), on the same turns."""
    records = doc["samples"]
    tasks = doc["config"]["tasks"]
    parts = [(t, p) for t in tasks for p in ("turn1", "followup")
             if p == "turn1" or any(len(r["rows"]["A"]["correct"]) > 1
                                    for r in records if r["task"] == t)]

    def bits(label, task, part):
        turns = slice(0, 1) if part == "turn1" else slice(1, None)
        return np.array([c for r in records if r["task"] == task
                         for c in r["rows"][label]["correct"][turns]], bool)

    head = "| rule | " + " | ".join(f"{t} {'t1' if p == 'turn1' else 'f/u'}"
                                     for t, p in parts) + " |"
    lines = [head, "|" + "---|" * (len(parts) + 1)]
    for label in doc["config"]["rows"]:
        if label == "A":
            continue
        cells = []
        for task, part in parts:
            full, row = bits("A", task, part), bits(label, task, part)
            cells.append(f"{100 * (row.mean() - full.mean()):+.0f} "
                         f"({int((full & ~row).sum())}/{int((row & ~full).sum())})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_sizes(text: str) -> TaskSizes:
    """``field=value,...`` over the default `TaskSizes` (e.g. long_chars=4600,long_kv_pairs=4)."""
    fields = {f.name: f for f in dataclasses.fields(TaskSizes)}
    changes = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in fields:
            raise SystemExit(f"--sizes: {item!r} is not field=value with a TaskSizes field "
                             f"({', '.join(fields)})")
        kind = type(getattr(TaskSizes(), name))
        try:
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                changes[name] = value.lower() == "true"
            else:
                changes[name] = kind(value)
        except ValueError:
            raise SystemExit(f"--sizes: {name} takes a value of type {kind.__name__}, "
                             f"got {value!r}") from None
    return dataclasses.replace(TaskSizes(), **changes)


def _choices(flag: str, text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """The comma-separated items of `text`, each one of `allowed` (else one error naming it)."""
    items = [x for x in text.split(",") if x]
    for x in items:
        if x not in allowed:
            raise SystemExit(f"{flag}: unknown {what} {x!r}; {what}s: {', '.join(allowed)}")
    return items


def print_tables(path: str) -> None:
    """The accuracy, digits-kept and (with full KV) paired tables of a results file."""
    doc = json.loads(Path(path).read_text())
    n = {t: len([r for r in doc["samples"] if r["task"] == t]) for t in doc["config"]["tasks"]}
    print(f"samples per task: {n}; seconds per sample: {doc['seconds_per_sample']}\n")
    print(markdown_table(doc["results"]) + "\n")
    print(markdown_table(doc["results"], "digits_kept") + "\n")
    if "A" in doc["config"]["rows"]:
        print(paired_table(doc))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model to load (`models.registry.load_model`: a GGUF or HF folder); "
                         "default the embedded SmolLM2-135M")
    ap.add_argument("--samples", type=int, default=40, help="samples per task (indices 0..)")
    ap.add_argument("--first", type=int, default=0, help="first sample index")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default=",".join(LONG_TASKS))
    ap.add_argument("--ratios", default="0.5,0.25")
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES),
                    help=f"comma-separated, of {', '.join(RULES)}, each but A also with a "
                         f"recall suffix ({', '.join(RECALL_SUFFIXES)}; "
                         "`_retention_rules.py` says what each keeps)")
    ap.add_argument("--budgets", default="profile,uniform",
                    help="profile (the shipped G=1 profile at the ratio) and/or uniform")
    ap.add_argument("--uniform-rules", default="B,C,D,E",
                    help="rules also run with uniform budgets (the control)")
    ap.add_argument("--sizes", default="",
                    help="TaskSizes fields to change, e.g. long_chars=4600,long_kv_pairs=4")
    ap.add_argument("--out", default=None,
                    help="result JSON, written after every sample (default: a fresh file under "
                         "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(ap)
    ap.add_argument("--resume", action="store_true", help="keep the samples already in --out")
    ap.add_argument("--print-tables", metavar="RESULTS",
                    help="print the tables of a results file and exit (runs nothing)")
    args = ap.parse_args(argv)
    if args.print_tables:
        print_tables(args.print_tables)
        return

    tasks = _choices("--tasks", args.tasks, LONG_TASKS, "long-session task")
    rules = [x for x in args.rules.split(",") if x]
    for x in rules:
        if not is_rule(x):
            raise SystemExit(f"--rules: unknown rule {x!r}; rules: {', '.join(RULES)}, each "
                             f"but A also with a recall suffix ({', '.join(RECALL_SUFFIXES)})")
    budgets_used = _choices("--budgets", args.budgets, BUDGETS, "budget")
    uniform_rules = _choices("--uniform-rules", args.uniform_rules, RULES, "rule")
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r]
    except ValueError:
        raise SystemExit(f"--ratios: expected comma-separated numbers, got {args.ratios!r}")
    for r in ratios:
        if f"{r:.2f}" not in ("0.25", "0.50"):
            raise SystemExit(f"--ratios: {r} has no shipped G=1 profile (0.25 or 0.5)")
    if args.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {args.samples}")
    if args.resume and args.out is None:
        ap.error("--resume continues the file --out names; none was given")
    sizes = parse_sizes(args.sizes)
    outputs = resolve_outputs(ap, args, {"out": "retention_proxy"})
    run = start("retention_proxy", outputs, argv)
    origin = provenance([__file__, *argv])   # once: the revision that runs, not a later one

    loaded = load_model(args.model)
    pm = ProxyModel(loaded)
    budgets = {}
    for r in ratios:
        budgets[("profile", r)] = BudgetProfile.load(
            PROFILES_DIR / f"smollm2-135m_snapkv_rho{r:.2f}_g1.json").budget
        budgets[("uniform", r)] = np.full_like(budgets[("profile", r)], r)
    rows = row_specs(rules, ratios, budgets_used, uniform_rules)
    out_path = Path(args.out)
    records = []
    if args.resume and out_path.exists():
        records = json.loads(out_path.read_text())["samples"]
        have = {row_label(*s) for s in rows}
        records = [r for r in records if have <= set(r["rows"])]
    done = {r["id"] for r in records}
    from tangram_jax.compression.pilot_data import haystack_text
    essays = haystack_text()
    # Index-major: a run cut short has the same samples of every task.
    samples = [generate(t, i, args.seed, sizes, essays)
               for i in range(args.first, args.first + args.samples) for t in tasks]
    print(f"{len(rows)} rows: {', '.join(row_label(*s) for s in rows)}", flush=True)

    def write():
        results = summarise(records, rows)
        seconds = {}
        for task in tasks:
            recs = [r for r in records if r["task"] == task]
            if recs:
                parts = {k for r in recs for k in r["seconds"]}
                seconds[task] = {k: float(np.mean([r["seconds"].get(k, 0.0) for r in recs]))
                                 for k in sorted(parts)}
                seconds[task]["total"] = float(np.mean([sum(r["seconds"].values())
                                                        for r in recs]))
        doc = dict(benchmark="retention_proxy", **origin,
                   config=dict(chunk=CHUNK, tail=TAIL, max_tokens=MAX_TOKENS, seed=args.seed,
                               sizes=dataclasses.asdict(sizes),
                               tasks=tasks, ratios=ratios, rules=rules,
                               budgets=budgets_used, uniform_rules=uniform_rules,
                               rows=[row_label(*s) for s in rows], batch_rows=len(rows)),
                   seconds_per_sample=seconds, results=results, samples=records)
        write_text_atomic(out_path, json.dumps(doc, indent=1))
        return results

    began = time.perf_counter()
    for i, sample in enumerate(samples):
        if sample.id in done:
            continue
        rec = evaluate_sample(pm, sample, rows, budgets, pm.inv_freq)
        records.append(rec)
        write()
        full = rec["rows"].get("A")
        print(f"[{i + 1}/{len(samples)}] {sample.id} n={rec['n_tokens']} "
              + " ".join(f"{k} {v:.1f}s" for k, v in rec["seconds"].items())
              + (f" full={full['correct']}" if full else "")
              + f" ({time.perf_counter() - began:.0f}s)", flush=True)
    print(markdown_table(write()))
    finish(run)


if __name__ == "__main__":
    main()
