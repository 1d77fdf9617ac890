"""The retention rules of `retention_proxy.py`: per-token scores from one dense pass of turn 1,
and each rule's keep mask per (layer, KV head).

Every rule keeps the protected tail (the turn's last ``TAIL`` tokens) and chooses among the
u = n - TAIL tokens before it; r is the head's budget. Per-chunk rules keep ``ceil(r * c)`` of
each chunk's c unprotected tokens, every other rule ``ceil(r * u)`` of the turn's
(`kv_layout.chunk_keep_count`).

  A     full KV
  B     per chunk (128): the chunk's SnapKV window scores (`chunk_scoring.chunk_scores`,
        rule "window", the engine's path)
  C     per chunk: window + KeyDiff of the chunk, union by rank (rule "window+keydiff")
  D     whole turn: SnapKV of the question's 32 queries (published SnapKV, deferred)
  E     whole turn: D union KeyDiff against the turn's mean key (window share 0.5)
  F     whole turn: KeyDiff alone
  G     whole turn: Expected Attention from the question window's query statistics
  H.25  E with window share 0.25;  H.75: window share 0.75
  I1-I6 "flow, fill-first": per-token scores fixed when each chunk is seen, the held set the
        top ceil(r * u) so far (with fixed scores: the turn's top ceil(r * u)):
        I1 KeyDiff vs the chunk's mean key; I2 vs the running mean of the turn's keys up to the
        chunk's end; I3 vs the mean of the turn's first 128 keys; I4 B's scores as 1 - rank/len
        within the chunk's unprotected tokens; I5 I4 union I2 by rank; I6 I2's survivors before
        the last chunk plus the last chunk re-ranked by I2 union the question window (D)
  J     KVzip-style: context + "Repeat the previous context:" + context again, each context
        token scored by the max attention (over the repeat's queries and the KV head's query
        heads) it gets; JD: J union D by rank
  Qo    the question-only window: the question's TAIL tokens run alone (no context) at their
        own positions; each query's logits against turn 1's keys are normalised by the
        question's own log-sum-exp (over the question's keys it sees), then pooled as D. A
        key's score depends on that key (and, through SnapKV's pooling, its 3 neighbours a
        side) and the question only, so a flow engine can compute it chunk by chunk (no
        softmax over the whole turn)
  Two lanes (greedy): the top ceil(s * count) by a first score, then the rest of the count by a
  second score among the tokens not yet kept (exactly `count` kept; a "union" above lets the
  lists overlap and reach further down instead):
  QoH1  Qo (s = 0.25), then KeyDiff against the turn's first 128 keys (a static anchor: a key's
        score is fixed once the first chunk is seen)
  QoE1  as QoH1 with s = 0.5
  QoHt  Qo (s = 0.25), then KeyDiff against the whole turn's mean key (the reference: not
        known until the turn ends)
  QoHq  Qo (s = 0.25), then KeyDiff against the mean of the question-only pass's keys
  DHg   D (s = 0.25), then KeyDiff against the turn's mean key (H.25 as two greedy lanes)
  DJg   D (s = 0.25), then J (the question window first, KVzip's reconstruction score for the
        rest: DHg with KVzip in place of KeyDiff)
  Stand-ins for J that need no second pass: the most attention (max over the KV head's query
  heads) a key gets from the turn's own queries before the question, in the prefill itself:
  Af    from every later query of the turn (an upper bound: the engine's chunks do not see the
        whole turn)
  Al    from the queries of the key's own chunk of 128 only (what an engine could compute per
        chunk from the chunk's attention and its log-sum-exp, and keep beside the held tokens)
  DAfg / DAlg  D (s = 0.25), then Af / Al (DJg with the stand-in in place of KVzip)
  P     a question-agnostic probe: context + a fixed request for the context's facts
        (`retention_proxy.PROBE_PROMPT`, ~20 tokens), the context scored by the probe's
        queries as D scores it by the question's (SnapKV: `probe_scores`): a short probe in
        place of KVzip's repeated context (an engine would run ~20 extra query tokens a turn
        instead of a second pass over it)
  DPg   D (s = 0.25), then P (DJg with the probe in place of KVzip)
  Variants of D's aggregation (the same question window, no extra pass):
  Dk11, Dk15, Dk21, Dk31  D pooled over 11 / 15 / 21 / 31 neighbouring keys instead of 7
        (a kept token brings a sentence: the window attends to every "door code of" phrase,
        the digits sit a few tokens after it)
  Dm    each key's largest attention from any one window query (over the window and the KV
        head's query heads) instead of the window's sum, pooled over 7 as D
  Dl    every KV head of a layer ranks by the layer's mean D score (a fact one head finds,
        every head keeps); Dlh: half the head's own D score, half the layer's mean
  DHg15 DHg with Dk15 as the first lane
  Recall (a suffix to any rule but A): turn 1 keeps what the rule keeps; the tokens it drops
  stay available (an engine would hold them in host memory), and before each follow-up turn
  its tokens run once over the kept context and score all of turn 1's (SnapKV over every
  context key: `retention_proxy.ProxyModel._extend`'s `score`), then the head's count is
  chosen again (`recall_keep`):
  X+R   the follow-up's top count among all of turn 1's tokens
  X+R.5 half the count: the held tokens the follow-up scores highest; the rest: its top among
        the others (evict later, never grow: the reservation's count stays)
  X+Rall every turn-1 token visible again from the first follow-up (the control: the most any
        recall could give back; it grows past the reservation)
  X+R2  X+R twice: the second scoring pass's queries see what the first recalled
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tangram_jax.compression.chunk_scoring import chunk_scores, union_by_rank
from tangram_jax.compression.scorers import (DEFAULT_KERNEL as SNAPKV_KERNEL,
                                             expected_attention, keydiff, pool1d,
                                             snapkv_from_probs)
from tangram_jax.kv_layout import chunk_keep_count

CHUNK = 128          # the CPU engine's compression chunk
TAIL = 32            # protected tail = SnapKV observation window
RULES = ("A", "B", "C", "D", "E", "F", "G", "H.25", "H.75",
         "I1", "I2", "I3", "I4", "I5", "I6", "J", "JD",
         "Qo", "QoH1", "QoE1", "QoHt", "QoHq", "DHg", "DJg", "Af", "Al", "DAfg", "DAlg",
         "P", "DPg", "Dk11", "Dk15", "Dk21", "Dk31", "Dm", "Dl", "Dlh", "DHg15")
KVZIP_RULES = ("J", "JD", "DJg")                                       # need the KVzip pass
PROBE_RULES = ("P", "DPg")                                             # need the probe pass
QUESTION_RULES = ("Qo", "QoH1", "QoE1", "QoHt", "QoHq")        # need the question-only pass
# Two greedy lanes: rule -> (first score, second score, the first lane's share of the count).
TWO_LANES = {"QoH1": ("Qo", "kd_first", 0.25), "QoE1": ("Qo", "kd_first", 0.5),
             "QoHt": ("Qo", "kd_turn", 0.25), "QoHq": ("Qo", "kd_question", 0.25),
             "DHg": ("D", "kd_turn", 0.25), "DJg": ("D", "J", 0.25),
             "DAfg": ("D", "Af", 0.25), "DAlg": ("D", "Al", 0.25), "DPg": ("D", "P", 0.25),
             "DHg15": ("Dk15", "kd_turn", 0.25)}
# D with a wider max pool: rule -> pooling width (keys).
POOL_WIDTHS = {"Dk11": 11, "Dk15": 15, "Dk21": 21, "Dk31": 31}


# suffix -> the share of the count chosen again (0: the whole turn, the +Rall control)
RECALL_SUFFIXES = {"+R": 1.0, "+R.5": 0.5, "+Rall": 0.0, "+R2": 1.0}
RECALL_ROUNDS = {"+R2": 2}   # scoring passes before a follow-up (default 1)


def recall_rounds(rule: str) -> int:
    """Scoring passes (each followed by a recall) before each follow-up turn of `rule`."""
    return next((n for suffix, n in RECALL_ROUNDS.items() if rule.endswith(suffix)), 1)


def split_recall(rule: str) -> tuple[str, float | None]:
    """("D", 1.0) of "D+R", ("D", 0.5) of "D+R.5", ("D", 0.0) of "D+Rall", (rule, None) of a
    rule without recall."""
    for suffix, share in RECALL_SUFFIXES.items():
        if rule.endswith(suffix) and rule[:-len(suffix)] in RULES[1:]:
            return rule[:-len(suffix)], share
    return rule, None


def is_rule(name: str) -> bool:
    return name in RULES or split_recall(name)[1] is not None


def recall_keep(scores: np.ndarray, held: np.ndarray, count: np.ndarray,
                share: float) -> np.ndarray:
    """A head's keep mask chosen again before a follow-up turn. scores [L, Hkv, u]: the
    attention the follow-up's tokens pay each of turn 1's (before pooling); held [L, Hkv, u]:
    the keep mask in force; count [L, Hkv]: the head's count (unchanged). `share` of the
    count is re-ranked over every token; the rest stays with the held tokens the follow-up
    scores highest. Share 0 (+Rall): every token."""
    if share == 0.0:
        return np.ones_like(held)
    pooled = np.asarray(pool1d(jnp.asarray(scores), SNAPKV_KERNEL, "max"))
    count = count[..., None]
    stay = np.floor((1.0 - share) * count + 1e-6).astype(int)
    kept = _rank_within(pooled, held) < stay
    rest = _rank_within(np.where(kept, -np.inf, pooled), ~kept)
    return kept | (rest < count - stay)


@dataclasses.dataclass
class QuestionPass:
    """The question's TAIL tokens run through the model alone, at their positions in turn 1."""

    q: np.ndarray     # [L, W, Hq, D] queries
    lse: np.ndarray   # [L, Hq, W] log-sum-exp of each query's logits over the question's keys
    k: np.ndarray     # [L, W, Hkv, D] keys


@dataclasses.dataclass
class Turn1:
    """What the rules see of one sample's turn 1 (arrays over the padded length N)."""

    n: int          # turn-1 tokens
    u: int          # unprotected tokens (n - TAIL)
    k: np.ndarray   # [L, N, Hkv, D]
    v: np.ndarray
    chunk_obs: np.ndarray   # [L, C, Hq, TAIL, CHUNK]
    turn_obs: np.ndarray    # [L, Hq, TAIL, N]
    q_window: np.ndarray    # [L, TAIL, Hq, D]
    attn_turn: np.ndarray | None = None    # [L, Hkv, N] (rules A*: `_dense_pass`)
    attn_chunk: np.ndarray | None = None
    question: QuestionPass | None = None   # the question-only pass (rules Qo*)

    @property
    def chunk_lens(self) -> np.ndarray:
        """[C] tokens of each chunk (0 past the turn's end)."""
        c = self.k.shape[1] // CHUNK
        return np.clip(self.n - CHUNK * np.arange(c), 0, CHUNK)

    @property
    def chunk_protected(self) -> np.ndarray:
        """[C] protected tokens at the end of each chunk (`KVLayout.chunk_protected`)."""
        start = CHUNK * np.arange(len(self.chunk_lens))
        return np.clip(start + self.chunk_lens - self.u, 0, self.chunk_lens)


@jax.jit
def _engine_chunk_scores(obs, k, chunk_lens, protected):
    """The engine's chunk scores (SnapKV window; window+keydiff) of every chunk of every layer.
    obs [L, C, Hq, W, 128], k [L, C, 128, Hkv, D] -> two [L, C, Hkv, 128]."""
    q_per_kv = obs.shape[2] // k.shape[3]

    def one(o, kc, length, prot, first, rule):
        q = jnp.zeros((kc.shape[0], o.shape[0], kc.shape[-1]), jnp.float32)  # unread by these
        return chunk_scores("snapkv", o, q, kc, kc, length, prot, first, q_per_kv=q_per_kv,
                            rule=rule)

    first = jnp.arange(obs.shape[1]) * CHUNK
    out = []
    for rule in ("window", "window+keydiff"):
        per_chunk = jax.vmap(lambda o, kc, ln, pr, fs: one(o, kc, ln, pr, fs, rule))
        out.append(jax.vmap(per_chunk, in_axes=(0, 0, None, None, None))(
            obs, k, chunk_lens, protected, first))
    return tuple(out)


def _keydiff_rows(keys, num_valid):
    """keydiff of keys [Hkv, T, D] with the anchor over the first num_valid -> [Hkv, T]
    (query-free: the queries it is handed are a placeholder)."""
    q = jnp.zeros((keys.shape[0], 1, keys.shape[-1]), jnp.float32)
    return keydiff(q, keys, keys, q_per_kv=1, num_valid=num_valid)


@jax.jit
def _keydiff_scores(k, anchors):
    """k [L, N, Hkv, D]; anchors [A] anchor lengths -> [A, L, Hkv, N]: KeyDiff of every key
    against the mean unit key of the first anchors[a] keys."""
    heads = jnp.moveaxis(k, 1, 2)                                   # [L, Hkv, N, D]
    per_layer = jax.vmap(_keydiff_rows, in_axes=(0, None))
    return jax.vmap(lambda a: per_layer(heads, a))(anchors)


@jax.jit
def _chunk_keydiff(k, chunk_lens):
    """k [L, C, 128, Hkv, D] -> [L, C, Hkv, 128]: KeyDiff against each chunk's own mean key."""
    per_chunk = jax.vmap(lambda kc, ln: _keydiff_rows(jnp.moveaxis(kc, 0, 1), ln))
    return jax.vmap(per_chunk, in_axes=(0, None))(k, chunk_lens)


@jax.jit
def _keydiff_against(k, anchor_keys):
    """k [L, N, Hkv, D], anchor_keys [L, W, Hkv, D] -> [L, Hkv, N]: KeyDiff of every key
    against the mean unit key of `anchor_keys` (the anchor keys go first, only they anchor)."""
    both = jnp.moveaxis(jnp.concatenate([anchor_keys, k], axis=1), 1, 2)   # [L, Hkv, W+N, D]
    width = anchor_keys.shape[1]
    return jax.vmap(lambda keys: _keydiff_rows(keys, width))(both)[..., width:]


@jax.jit
def _question_window(q, lse, k, n):
    """The question-only pass's attention over turn 1's keys, normalised by its own attention:
    q [L, W, Hq, D], lse [L, Hq, W] (the question's log-sum-exp over its own keys), k [L, N,
    Hkv, D] (the dense pass's keys) -> [L, Hq, W, N]: exp(logit - lse) for the keys at or
    before each query's position n - W + w, 0 after. (Rows do not sum to 1 over turn 1's keys:
    the context's keys were not in the question's softmax.)"""
    w, num_heads, d = q.shape[1:]
    big_n, num_kv = k.shape[1:3]
    keys = jnp.repeat(k.astype(jnp.float32), num_heads // num_kv, axis=2)   # [L, N, Hq, D]
    logits = jnp.einsum("lwhd,lnhd->lhwn", q.astype(jnp.float32), keys) * d ** -0.5
    visible = jnp.arange(big_n)[None, :] <= (n - w + jnp.arange(w))[:, None]   # [W, N]
    return jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)


@functools.partial(jax.jit, static_argnames=("q_per_kv", "kernel", "reduce"))
def _turn_window_scores(turn_obs, n, *, q_per_kv: int, kernel: int = SNAPKV_KERNEL,
                        reduce: str = "sum"):
    """Published SnapKV of the turn's last TAIL queries: turn_obs [L, Hq, W, N] -> [L, Hkv, N].
    Valid keys are rotated to the end (as `snapkv_chunk_scores` does) so that the window is
    the last W keys of the array. kernel: the pooling width; reduce "max": each key's largest
    attention from one query (over the window and the KV head's query heads) for the sum."""
    big_n, w = turn_obs.shape[-1], turn_obs.shape[-2]
    shift = big_n - n
    rolled = jnp.roll(turn_obs, shift, axis=-1)
    if reduce == "max":
        num_q = rolled.shape[1]
        most = rolled.max(axis=2).reshape(rolled.shape[0], num_q // q_per_kv, q_per_kv, big_n)
        rolled = jnp.repeat(most.max(axis=2), q_per_kv, axis=1)[:, :, None]   # [L, Hq, 1, N]
    per_layer = jax.vmap(lambda o: snapkv_from_probs(o, q_per_kv, kernel=kernel,
                                                     protect_window=True,
                                                     window_start=big_n - w))
    return jnp.roll(per_layer(rolled), -shift, axis=-1)


def probe_scores(probe_obs, n, *, q_per_kv: int):
    """Rule P's scores: SnapKV of the probe's queries, probe_obs [L, Hq, W, N2] (the context
    and the probe of n tokens, padded to N2) -> [L, Hkv, N2], as D's of the question."""
    return _turn_window_scores(probe_obs, n, q_per_kv=q_per_kv)


@functools.partial(jax.jit, static_argnames=("q_per_kv",))
def _expected_attention_scores(q_window, k, v, n, inv_freq, *, q_per_kv: int):
    """Expected Attention of turn 1's keys from the window queries' statistics -> [L, Hkv, N].

    The scorer wants its queries to be the last ones of the keys and no padding among them:
    the keys are rotated so the n real ones come last, with first_position = n - N so that
    every real key keeps its position (the padding then sits at negative positions, which the
    scorer treats as sinks: out of the softmax; its scores are dropped)."""
    t = k.shape[1]
    shift = t - n
    heads = lambda x: jnp.moveaxis(jnp.roll(x, shift, axis=1), 1, 2)   # noqa: E731
    scores = jax.vmap(lambda q, kk, vv: expected_attention(
        jnp.moveaxis(q, 0, 1), kk, vv, q_per_kv=q_per_kv, inv_freq=inv_freq,
        first_position=n - t))(q_window, heads(k), heads(v))
    return jnp.roll(scores, -shift, axis=-1)


def _union(first: np.ndarray, second: np.ndarray, u: int, share: float) -> np.ndarray:
    """`chunk_scoring.union_by_rank` over [L, Hkv, N] arrays, tokens < u ranked."""
    shape = first.shape
    out = union_by_rank(jnp.asarray(first).reshape(-1, shape[-1]),
                        jnp.asarray(second).reshape(-1, shape[-1]), u, share)
    return np.asarray(out).reshape(shape)


def _rank_within(scores: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rank (0 = best) of each position along the last axis among `valid` ones (stable: earlier
    first on ties); invalid positions get ranks after every valid one."""
    masked = np.where(valid, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(scores.shape[-1]), axis=-1)
    return ranks


def rule_scores(t1: Turn1, rules: list[str], kvzip: np.ndarray | None, inv_freq,
                q_per_kv: int, probe: np.ndarray | None = None) -> dict:
    """rule -> ("turn", scores [L, Hkv, N]) | ("chunk", scores [L, C, Hkv, 128]) |
    ("flow", (survivor scores, final scores) [L, Hkv, N] each) | ("lanes", (first, second
    [L, Hkv, N], the first lane's share)). Higher is kept first. kvzip [L, Hkv, N2]: the KVzip
    pass's scores (rules J, JD); probe [L, Hkv, N3]: the probe pass's (P, DPg); the Qo rules
    need `t1.question`."""
    n, u = t1.n, t1.u
    num_layers, big_n = t1.k.shape[:2]
    c = big_n // CHUNK
    lens, prot = t1.chunk_lens, t1.chunk_protected
    k_chunks = t1.k.reshape(num_layers, c, CHUNK, *t1.k.shape[2:])
    want = set(rules)
    out: dict = {}
    cache: dict = {}

    def get(name, make):
        if name not in cache:
            cache[name] = make()
        return cache[name]

    window_chunk = lambda: _engine_chunk_scores(t1.chunk_obs, k_chunks, lens, prot)  # noqa: E731
    per_token = lambda x: np.moveaxis(np.asarray(x), 2, 1).reshape(  # noqa: E731
        num_layers, -1, big_n)                        # [L, C, Hkv, 128] -> [L, Hkv, N]
    turn_window = lambda: np.asarray(_turn_window_scores(  # noqa: E731
        t1.turn_obs, n, q_per_kv=q_per_kv))
    chunk_ends = np.minimum(CHUNK * np.arange(1, c + 1), n)
    keydiffs = lambda: np.asarray(_keydiff_scores(  # noqa: E731
        t1.k, jnp.asarray(np.concatenate([[n, min(CHUNK, n)], chunk_ends]))))
    turn_kd = lambda: get("kd", keydiffs)[0]          # noqa: E731
    first_kd = lambda: get("kd", keydiffs)[1]         # noqa: E731

    def running_kd():   # each key against the mean unit key up to its chunk's end
        per_anchor = get("kd", keydiffs)[2:]            # [C, L, Hkv, N]
        chunk_of = np.minimum(np.arange(big_n) // CHUNK, c - 1)
        return np.take_along_axis(np.moveaxis(per_anchor, 0, -1),
                                  chunk_of[None, None, :, None], axis=-1)[..., 0]

    def rank_per_chunk():   # B's scores as 1 - rank / unprotected length, per chunk
        b = np.asarray(get("wc", window_chunk)[0])      # [L, C, Hkv, 128]
        free = (lens - prot)[None, :, None, None]
        valid = np.arange(CHUNK)[None, None, None, :] < free
        ranks = _rank_within(b, valid)
        return per_token(np.where(valid, 1.0 - ranks / np.maximum(free, 1), -np.inf))

    def question():
        if t1.question is None:
            raise ValueError(f"the rules {', '.join(QUESTION_RULES)} need the question-only "
                             "pass (Turn1.question)")
        return t1.question

    def question_window():   # Qo: the question-only pass's window, pooled as D's
        qp = question()
        return np.asarray(_turn_window_scores(_question_window(qp.q, qp.lse, t1.k, n), n,
                                              q_per_kv=q_per_kv))

    def window_variant(name, **kw):
        return lambda: get(name, lambda: np.asarray(_turn_window_scores(
            t1.turn_obs, n, q_per_kv=q_per_kv, **kw)))

    def layer_shared(own_share):   # each head: own_share of its D score + the layer's mean
        def make():
            d = get("tw", turn_window)
            return own_share * d + (1.0 - own_share) * d.mean(axis=1, keepdims=True)
        return make

    lanes = {"Qo": question_window, "D": lambda: get("tw", turn_window), "kd_turn": turn_kd,
             **{name: window_variant(name, kernel=width) for name, width in POOL_WIDTHS.items()},
             "kd_first": first_kd,
             "kd_question": lambda: np.asarray(_keydiff_against(t1.k, question().k))}

    if "B" in want:
        out["B"] = ("chunk", np.asarray(get("wc", window_chunk)[0]))
    if "C" in want:
        out["C"] = ("chunk", np.asarray(get("wc", window_chunk)[1]))
    if "D" in want:
        out["D"] = ("turn", get("tw", turn_window))
    for name, share in (("E", 0.5), ("H.25", 0.25), ("H.75", 0.75)):
        if name in want:
            out[name] = ("turn", _union(get("tw", turn_window), turn_kd(), u, share))
    if "F" in want:
        out["F"] = ("turn", turn_kd())
    variants = {**{name: lanes[name] for name in POOL_WIDTHS},
                "Dm": window_variant("Dm", reduce="max"),
                "Dl": layer_shared(0.0), "Dlh": layer_shared(0.5)}
    for name, make in variants.items():
        if name in want:
            out[name] = ("turn", make())
    if "G" in want:
        out["G"] = ("turn", np.asarray(_expected_attention_scores(
            t1.q_window, t1.k, t1.v, n, inv_freq, q_per_kv=q_per_kv)))
    if "I1" in want:
        out["I1"] = ("turn", per_token(_chunk_keydiff(k_chunks, lens)))
    if "I2" in want:
        out["I2"] = ("turn", get("rk", running_kd))
    if "I3" in want:
        out["I3"] = ("turn", first_kd())
    if "I4" in want:
        out["I4"] = ("turn", get("rpc", rank_per_chunk))
    if "I5" in want:
        out["I5"] = ("turn", _union(get("rpc", rank_per_chunk), get("rk", running_kd), u, 0.5))
    if "I6" in want:
        out["I6"] = ("flow", (get("rk", running_kd),
                              _union(get("tw", turn_window), get("rk", running_kd), u, 0.5)))
    def context_scores(scores, rules_needing, what):   # [L, Hkv, N]: a pass's, of the context
        def make():
            if scores is None:
                raise ValueError(f"the rules {', '.join(rules_needing)} need the {what}")
            j = np.full((num_layers, t1.k.shape[2], big_n), -np.inf, np.float32)
            j[..., :u] = scores[..., :u]
            return j
        return make

    kvzip_scores = context_scores(kvzip, KVZIP_RULES, "KVzip pass")
    lanes["J"] = kvzip_scores
    lanes["P"] = context_scores(probe, PROBE_RULES, "probe pass")
    if "P" in want:
        out["P"] = ("turn", get("P", lanes["P"]))

    def own_attention(name):   # Af / Al: the context's keys ranked, the rest never
        def make():
            a = np.full((num_layers, t1.k.shape[2], big_n), -np.inf, np.float32)
            a[..., :u] = (t1.attn_turn if name == "Af" else t1.attn_chunk)[..., :u]
            return a
        return make

    for name in ("Af", "Al"):
        lanes[name] = own_attention(name)
        if name in want:
            out[name] = ("turn", get(name, lanes[name]))
    if "J" in want or "JD" in want:
        j = get("J", kvzip_scores)
        if "J" in want:
            out["J"] = ("turn", j)
        if "JD" in want:
            out["JD"] = ("turn", _union(get("tw", turn_window), j, u, 0.5))
    if "Qo" in want:
        out["Qo"] = ("turn", get("Qo", question_window))
    for name, (first, second, share) in TWO_LANES.items():
        if name in want:
            out[name] = ("lanes", (get(first, lanes[first]), get(second, lanes[second]), share))
    return out


def keep_mask(kind: str, scores, t1: Turn1, budget: np.ndarray) -> np.ndarray:
    """bool [L, Hkv, u]: the unprotected tokens each head keeps (budget [L, Hkv] in (0, 1])."""
    u = t1.u
    if kind == "chunk":
        keep = np.zeros((*budget.shape, u), bool)
        for c, (length, prot) in enumerate(zip(t1.chunk_lens, t1.chunk_protected)):
            free = int(length - prot)
            if free <= 0:
                continue
            # The engine keeps count + protected of the chunk by scores where the protected
            # tokens are on top; the unprotected part is the top `count` of the rest.
            count = chunk_keep_count(budget, free)
            ranks = _rank_within(scores[:, c, :, :free], np.ones(free, bool))
            keep[..., c * CHUNK:c * CHUNK + free] = ranks < count[..., None]
        return keep
    count = chunk_keep_count(budget, u)[..., None]
    valid = np.ones(u, bool)
    if kind == "turn":
        return _rank_within(scores[..., :u], valid) < count
    if kind == "lanes":   # the first lane's top ceil(share * count), then the second's
        first, second, share = scores
        first_count = np.ceil(share * count - 1e-6).astype(int)
        in_first = _rank_within(first[..., :u], valid) < first_count
        rest = _rank_within(np.where(in_first, -np.inf, second[..., :u]), ~in_first)
        return in_first | (rest < count - first_count)
    # "flow": survivors of the chunks before the last (top count by the running score), then
    # the last chunk's tokens join them and the final score re-ranks the candidates.
    survivor, final = (s[..., :u] for s in scores)
    last_start = CHUNK * ((u - 1) // CHUNK)   # the last chunk with unprotected tokens
    before = np.arange(u) < last_start
    candidate = (_rank_within(survivor, before) < count) & before | ~before
    return _rank_within(final, candidate) < count

