"""The KV layout: how one model's KV cache is cut into head groups and pages.

This is the contract shared by the scheduler (host side, which reserves pages), the kernels
(device side, which read and write them), the calibration (which produces the budgets) and the
engine. Every mode of the engine is a `KVLayout`:

- ``full``     one group of all KV heads per layer, budget 1 (vLLM's PagedAttention);
- ``dynamic``  one group of all KV heads, the per-input selection decides the count, and the
               pages above it are reclaimed after compression;
- ``tangram``  groups of G heads clustered by calibrated budget, each with its own page table.

Page layout (one pool serves every layer and group because every page has the same shape)::

    k_pages, v_pages: [num_pages, G, page_size, head_dim]

The pool's page format is `EngineConfig.kv_precision` (`tangram_jax.kv_quant`): ``bf16`` pages
of values as above, or quantised K8V8 / K8V4 / K4V2 pages (packed codes plus a float32 scale and
zero per slot) of the same logical shape, equal bytes within a format. Precision tiers
(`TieredLayout`, ``k8v4-k4v2``) split each group's retained tokens into a high and a low tier
with static budgets, reserved per (layer, group, tier); each tier has its own pool of pages (of
its format, page 0 its null page), sized by the tier's share of the retained tokens
(`TieredLayout.pool_pages`), and a tier group's block-table entries index its tier's pool.

A page holds `page_size` token slots of the G heads of ONE group of ONE layer. Block tables are
``[seq_slot, layer, group, max_pages]`` int32 and retained lengths ``[seq_slot, layer, group]``.
Within a group, head ``j`` of the page is the layer's KV head ``head_perm[layer, group*G + j]``
(weights are permuted at load time so that this is a contiguous slice of heads).

Retention rule (the single source of truth for how many tokens a group keeps; the scheduler
reserves exactly this, the prefill writes exactly this and the engine's history bookkeeping counts
exactly this). A turn's new tokens are prefilled in chunks of `chunk_size` from the turn's start
(the last one may be shorter). The turn's *protected tail* (`KVLayout.protected_tail`) is kept
whole: the model has not answered the turn yet, and its last tokens are the question and the chat
template's generation prompt, which compression must not cut before they are used. Tail rules
(`TAIL_RULES`):

- ``"window"``       the last ``tail_window`` tokens of the turn (the observation window);
- ``"final_chunk"``  the whole last chunk of the turn;
- ``"none"``         nothing.

How the count of a turn is spread over its chunks is the retention (`RETENTIONS`,
`EngineConfig.retention`):

- ``"turn"``   every chunk is held whole while the turn is prefilled; its last chunk compresses the
               whole turn at once, scored by the turn's own question (its last ``obs_window``
               queries attend over every token of the turn) and a question-agnostic ranking:
               SnapKV as published, whatever the turn's length. A group of budget r keeps
               ``min(u, ceil(r * u)) + p`` tokens of a turn whose unprotected part is u tokens
               and protected tail p. While the turn is prefilled it holds all its tokens: the
               scheduler reserves that peak (`peak_retained_counts`) and returns the pages above
               the final count when the prefill ends, so a long prefill borrows uncompressed
               pages for as long as it runs;
- ``"chunk"``  each chunk of n tokens keeps ``min(u, ceil(r * u)) + p`` of its own (u = n - p,
               p its protected tokens), scored by its own last ``obs_window`` queries, locked in:
               no staging, but a chunk is scored before the turn's question exists.

Why "turn" is the default: on turns that span many chunks (the serving benchmarks' 32k-100k
turns; the accuracy harness's long-session tasks) a fixed share per chunk, scored before the
question exists, keeps a chunk of filler as much as the chunk that holds the only fact, and
answered long-session follow-ups at 0.5 half as often as full KV; rankings that let the budget
flow across chunks by question-free scores did no better; only the whole turn scored by its
question came within a few points of full KV at 0.5
(`benchmarks/results/retention_proxy_gpu.json`). It costs the attention saving inside a turn
while it is prefilled (its chunks attend to the uncompressed turn) and the staging pages; later
turns still attend to the compressed history. Precision tiers split each chunk's kept tokens by
rank as it is written and dynamic mode is the per-chunk method as published: both use ``"chunk"``.

Held turn view (`TURN_VIEWS`, `EngineConfig.turn_view`): what a held turn's chunks attend to
before its last one.

- ``"whole"``   every held token of the turn: the prefill of a turn of n tokens attends over
                ~n^2 / 2 token pairs, as full KV's does;
- ``"recent"``  the session's compressed history, the turn's first page and its last
                ``max(chunk, ceil(r * held))`` held tokens (`held_turn_skip`; an attention sink
                and a local window, MInference's "A-shape"): about the pairs a chunk of
                ``"chunk"`` retention attends over. The turn's last chunk, whose question scores
                the turn, attends to every held token; what is kept is chosen as under
                ``"whole"``, from keys and values each computed over its recent context.

Why ``"recent"`` is the default: it keeps the question-scored whole-turn selection at about
retention ``"chunk"``'s prefill cost. On the 8B shape (H200, Long 8 x 100k, ratio 0.25) it
served 0.592 turns/s against ``"whole"``'s 0.366 and ``"chunk"``'s 0.638
(`benchmarks/results/serve_gpu_view_long.json`); on the long-session tasks (100 samples a
task, turns of 9-10 chunks of 128) it answered as ``"whole"`` at 0.5 (facts / passkey / kv 61 /
97 / 44% against 62 / 97 / 46) and lost 13 points on the facts at 0.25 (47 against 60;
`accuracy_long.json`), still far above ``"chunk"`` (27 / 62 / 21 at 0.5). Attending to at least
half of the held turn at 0.25 won back 5 of them for a fifth of the speed
(`accuracy_long_view_floor.json`, `serve_gpu_view_floor_long.json`): not kept. With the
question window pooled over 15 keys (`chunk_scoring.TURN_POOL_KERNEL`, below) the gap at 0.25
is 5 points: 60 / 93 / 46 against ``"whole"``'s 65 / 98 / 52 and full KV's 66 / 98 / 50
(`accuracy_long_pool15.json`), so ``"recent"`` stays the default.

How a whole turn is ranked (`chunk_scoring.turn_scores`): SnapKV of the turn's question window,
max-pooled over `chunk_scoring.TURN_POOL_KERNEL` = 15 neighbouring keys instead of SnapKV's 7.
A question matches every sentence of its kind (each "door code of ...", each "value of the key
..."), and a fact's value sits a few tokens after the words matched, so the wider pool keeps
the facts later turns ask beside the one this turn asks. On the long-session tasks (H200, 100 a
task) that moved tangram 0.25 from 47 / 91 / 27 (follow-ups 42) to 60 / 93 / 46 (56), full KV
66 / 98 / 50 (60), and made a question-agnostic share of the count (KeyDiff) unnecessary; the
offline proxy gave the same at 0.5 (`retention_proxy_pool_gpu.json`).

Which tokens a head keeps (never how many: the counts above are the scheduler's) is the scoring
rule (`chunk_scoring.SCORING_RULES`, `EngineConfig.scoring_rule`): ``"window"`` ranks by the
method's scores alone (SnapKV: the observation window); ``"window+context"`` and
``"window+keydiff"`` fill a share of each head's count by that ranking and the rest by a
question-agnostic one (the attention of queries spread over the chunk, or KeyDiff's key
distinctiveness), so that what a later turn asks about, and the current question does not, has a
share of the budget. The same jnp scores feed the XLA path and the Pallas path (selection
happens before the write kernel), and the protected tail stays above both.

Decode appends one token to every group per step, uncompressed.

Local (sliding-window) layers (Gemma-3, GPT-OSS, Mistral: `ModelConfig.layer_windows`): a local
layer's query at slot t reads key slots > t - window only (`pallas_kernels.attention_terms`).
The window is by slot, and a slot is the token's position only where the layer drops nothing,
so a local layer keeps every token: its groups' budgets are 1 in every layout (a tangram profile
with a local budget below 1 is refused, `check_local_layers`; calibration writes 1 for them and
fits the ratio over the global layers), and it needs no compression budget anyway, since the
window already bounds what it reads to `window` tokens however long the context. Dynamic mode
(a per-input count per layer) and precision tiers (a group's tokens split over two pools by
rank) would break slot = position and are refused for such models. What a local layer's pages
hold before its window is never read again (attention skips those blocks); recycling them to
the pool (the block-table entries behind the window pointed at the null page, the pages freed)
is the scheduler's part and is not built: the reservation still counts a local layer's whole
context.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Guards ceil() against r * n landing a hair above an integer in floating point
# (0.1 * 30 = 3.0000000000000004 must keep 3, not 4).
_CEIL_EPS = 1e-6

TAIL_RULES = ("window", "final_chunk", "none")
# How a turn's retained count is spread over its chunks (module docstring, "Retention rule"):
# "turn" holds the turn whole and compresses it at its last chunk; "chunk" keeps a fixed share
# of every chunk, locked in.
RETENTIONS = ("turn", "chunk")
# What a chunk of a held turn attends to before the turn's last chunk (module docstring, "Held
# turn view"): every held token ("whole") or the turn's first page and its recent share.
TURN_VIEWS = ("whole", "recent")


def chunk_keep_count(group_budgets: np.ndarray, chunk_len: int | np.ndarray) -> np.ndarray:
    """Tokens each group keeps from one chunk of `chunk_len` tokens.

    group_budgets: float [..., groups] in (0, 1]; chunk_len: int or int array broadcastable.
    Returns int64 of the broadcast shape: ``min(n, ceil(r * n))``, and 0 for an empty chunk.
    """
    r = np.asarray(group_budgets, dtype=np.float64)
    n = np.asarray(chunk_len, dtype=np.int64)
    keep = np.ceil(r * n - _CEIL_EPS).astype(np.int64)
    return np.minimum(np.maximum(keep, np.minimum(n, 1)), n)


def chunk_lengths(num_tokens: int, chunk_size: int) -> list[int]:
    """The chunk lengths a turn of `num_tokens` new tokens is compressed in."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    full, rest = divmod(num_tokens, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def protected_tail(turn_len: int, chunk_size: int, rule: str, window: int) -> int:
    """Tokens at the end of a turn of `turn_len` new tokens that are kept uncompressed."""
    if turn_len < 0:
        raise ValueError(f"turn_len must be >= 0, got {turn_len}")
    if rule == "window":
        return min(turn_len, window)
    if rule == "final_chunk":
        return turn_len - chunk_size * ((turn_len - 1) // chunk_size) if turn_len else 0
    if rule == "none":
        return 0
    raise ValueError(f"unknown tail rule {rule!r}; expected one of {TAIL_RULES}")


def retained_counts(group_budgets: np.ndarray, num_tokens: int, chunk_size: int, *,
                    tail: int = 0) -> np.ndarray:
    """Tokens each group retains after chunked compression of a turn of `num_tokens` new prompt
    tokens whose last `tail` tokens are protected (kept whole).

    group_budgets: [layers, groups] (or any [..., groups]). Returns int64 of the same shape.
    """
    budgets = np.asarray(group_budgets, dtype=np.float64)
    tail = min(int(tail), int(num_tokens))
    full, rest = divmod(int(num_tokens) - tail, chunk_size)
    counts = full * chunk_keep_count(budgets, chunk_size) + tail
    if rest:
        counts = counts + chunk_keep_count(budgets, rest)
    return np.asarray(counts, dtype=np.int64)


def held_turn_skip(hist, turn_hist, group_budgets, chunk_size: int, page_size: int,
                   windowed_layers=()) -> np.ndarray:
    """Pages of a held turn that a prefill row's attention skips under the ``"recent"`` view
    (module docstring, "Held turn view"): of the turn's held slots ``turn_hist .. hist - 1`` a
    row attends to the page holding the turn's first slot (with everything before it: the
    session's compressed history) and the last ``max(chunk_size, ceil(r * held))`` held
    tokens, rounded out to whole pages; the pages between are skipped. The attended slots,
    renumbered, are ``hist - skip * page_size`` contiguous ones (every page but the last of the
    view is full), so attention reads them through a block table whose columns after the first
    page jump `skip` pages.

    hist, turn_hist: int [..., layers, groups] (the group's retained tokens before the row and
    before its turn); group_budgets: float [layers, groups]; windowed_layers: the layers of a
    sliding window (they skip nothing: their window is counted in slots). Returns int32 of
    hist's shape, 0 where nothing is skipped.
    """
    hist = np.asarray(hist, np.int64)
    turn_hist = np.asarray(turn_hist, np.int64)
    held = hist - turn_hist
    recent = np.maximum(chunk_size, np.ceil(np.asarray(group_budgets) * held - _CEIL_EPS))
    first = turn_hist // page_size
    start = (hist - recent.astype(np.int64)) // page_size     # the recent share's first page
    skip = np.maximum(start - first - 1, 0)
    if len(windowed_layers):
        skip[..., list(windowed_layers), :] = 0
    return skip.astype(np.int32)


def pages_for(num_tokens: np.ndarray | int, page_size: int) -> np.ndarray:
    """Pages needed to hold `num_tokens` slots (elementwise ceil division)."""
    n = np.asarray(num_tokens, dtype=np.int64)
    return (n + page_size - 1) // page_size


@dataclasses.dataclass(frozen=True, eq=False)
class KVLayout:
    """Static description of the paged, grouped KV cache of one model.

    Attributes:
      num_layers, num_kv_heads, head_dim: the model's KV shape.
      group_size: G, KV heads per group (divides num_kv_heads).
      page_size: token slots per page.
      chunk_size: prefill compression chunk (tokens).
      head_perm: int32 [layers, kv_heads]; group g of layer l holds heads
        ``head_perm[l, g*G:(g+1)*G]``.
      group_budgets: float64 [layers, groups] in (0, 1]; 1 means nothing dropped.
      name: a label for reports (``tangram``, ``full``, ``adjacent`` ...).
      tail_rule, tail_window: which end of every turn is kept uncompressed (`TAIL_RULES`; the
        module docstring). The engine uses ``"window"`` with its observation window.
      retention: how a turn's count is spread over its chunks (`RETENTIONS`, the module
        docstring): ``"turn"`` (held whole, compressed at its last chunk) or ``"chunk"`` (a
        fixed share of each chunk).
      turn_view: what a held turn's chunks before its last attend to under ``"turn"``
        retention (`TURN_VIEWS`, `held_turn_skip`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    page_size: int
    chunk_size: int
    head_perm: np.ndarray
    group_budgets: np.ndarray
    name: str = "tangram"
    tail_rule: str = "none"
    tail_window: int = 0
    retention: str = "chunk"
    turn_view: str = "recent"

    def __post_init__(self):
        if self.group_size <= 0 or self.num_kv_heads % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} must divide num_kv_heads {self.num_kv_heads}")
        if self.page_size <= 0 or self.chunk_size <= 0:
            raise ValueError(f"page_size ({self.page_size}) and chunk_size ({self.chunk_size}) "
                             "must be positive")
        if self.tail_rule not in TAIL_RULES:
            raise ValueError(f"tail_rule must be one of {TAIL_RULES}, got {self.tail_rule!r}")
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {self.retention!r}")
        if self.turn_view not in TURN_VIEWS:
            raise ValueError(f"turn_view must be one of {TURN_VIEWS}, got {self.turn_view!r}")
        if self.tail_rule == "window" and self.tail_window < 1:
            raise ValueError(f"tail_window must be >= 1 for the 'window' tail rule, got "
                             f"{self.tail_window}")
        perm = np.asarray(self.head_perm, dtype=np.int32)
        if perm.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"head_perm has shape {perm.shape}, expected "
                             f"{(self.num_layers, self.num_kv_heads)} [layers, kv_heads]")
        if not (np.sort(perm, axis=1) == np.arange(self.num_kv_heads)).all():
            raise ValueError("head_perm must be a permutation of the KV heads in every layer")
        budgets = np.asarray(self.group_budgets, dtype=np.float64)
        if budgets.shape != (self.num_layers, self.num_groups):
            raise ValueError(f"group_budgets has shape {budgets.shape}, expected "
                             f"{(self.num_layers, self.num_groups)} [layers, groups]")
        if not np.all((budgets > 0) & (budgets <= 1)) or not np.isfinite(budgets).all():
            raise ValueError("group budgets must lie in (0, 1]")
        object.__setattr__(self, "head_perm", perm)
        object.__setattr__(self, "group_budgets", budgets)
        # The keep rule as a lookup, [chunk_size + 1, layers, groups]: the count of a chunk of
        # every length (the scheduler and the engine ask for it on their hot paths). Read-only:
        # `chunk_keep_counts` hands out its rows.
        keep_by_chunk_len = chunk_keep_count(budgets, np.arange(self.chunk_size + 1)[:, None, None])
        keep_by_chunk_len.flags.writeable = False
        object.__setattr__(self, "_keep_by_chunk_len", keep_by_chunk_len)

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_size

    @property
    def compresses(self) -> bool:
        return bool((self.group_budgets < 1).any())

    def protected_tail(self, turn_len: int) -> int:
        """Tokens at the end of a turn of `turn_len` new tokens kept uncompressed."""
        return protected_tail(int(turn_len), self.chunk_size, self.tail_rule, self.tail_window)

    def retained_counts(self, num_tokens: int, *, upto: int | None = None) -> np.ndarray:
        """int64 [layers, groups] tokens kept from a turn of `num_tokens` new prompt tokens
        (`retained_counts` of this layout, read from the per-chunk-length keep table).

        upto: count only the turn's first `upto` tokens (a chunk boundary of the turn, or
        `num_tokens`): what the prefill pieces up to there write. Default: the whole turn.
        """
        n = int(num_tokens)
        if n < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        upto = n if upto is None else int(upto)
        if not 0 <= upto <= n or (upto % self.chunk_size and upto != n):
            raise ValueError(f"upto must be a chunk boundary of the turn in [0, {n}] or {n}, "
                             f"got {upto}")
        boundary = n - self.protected_tail(n)       # tokens [boundary, n) are kept whole
        compressed = min(upto, boundary)
        if self.retention == "turn":
            if upto < n:        # the turn is held whole until its last chunk
                return np.full(self.group_budgets.shape, upto, np.int64)
            return self.turn_keep_counts(boundary) + (n - boundary)
        full, rest = divmod(compressed, self.chunk_size)
        keep = self._keep_by_chunk_len
        return keep[-1] * full + keep[rest] + max(0, upto - boundary)

    def turn_keep_counts(self, num_unprotected: int) -> np.ndarray:
        """int64 [layers, groups]: under ``"turn"`` retention, tokens each group keeps of a
        turn's `num_unprotected` tokens before its protected tail: ``min(u, ceil(r * u))``
        (`chunk_keep_count` of the whole unprotected part, however it is chunked)."""
        return chunk_keep_count(self.group_budgets, int(num_unprotected))

    def peak_retained_counts(self, num_tokens: int) -> np.ndarray:
        """int64 [layers, groups]: the most tokens a group holds while a turn of `num_tokens`
        new tokens is prefilled (what admission reserves): the whole turn under ``"turn"``
        retention, its retained count under ``"chunk"`` (which never holds more)."""
        final = self.retained_counts(num_tokens)
        if self.retention == "turn":
            return np.maximum(final, int(num_tokens))
        return final

    def segments_peak_counts(self, segments) -> np.ndarray:
        """int64 [layers, groups]: the most tokens a group holds while prefill segments
        ``(length, compressed)`` are replayed one after another (`segments_retained_counts`):
        each compressed segment peaks at `peak_retained_counts` on top of what the ones before
        it keep."""
        held = np.zeros(self.group_budgets.shape, np.int64)
        peak = held
        for length, compressed in segments:
            top = held + (self.peak_retained_counts(length) if compressed else int(length))
            peak = np.maximum(peak, top)
            held = held + (self.retained_counts(length) if compressed else int(length))
        return peak

    def segments_retained_counts(self, segments) -> np.ndarray:
        """int64 [layers, groups] tokens kept from prefill segments ``(length, compressed)``:
        a compressed one is a turn (`retained_counts`), the others are kept whole (tokens a
        decode step wrote, replayed after a preemption)."""
        total = np.zeros(self.group_budgets.shape, np.int64)
        for length, compressed in segments:
            total = total + (self.retained_counts(length) if compressed else int(length))
        return total

    def piece_retained_counts(self, turn_len: int, start: int, end: int) -> np.ndarray:
        """int64 [layers, groups] tokens kept from tokens [start, end) of a turn of `turn_len`
        new tokens (start and end on chunk boundaries of the turn, or end == turn_len): the
        change in what the group holds, negative for the last piece of a turn under ``"turn"``
        retention (it compresses everything held before it)."""
        return (self.retained_counts(turn_len, upto=end)
                - self.retained_counts(turn_len, upto=start))

    def chunk_protected(self, turn_len: int, start: int, chunk_len: int) -> int:
        """How many of the last tokens of the chunk [start, start + chunk_len) of a turn of
        `turn_len` tokens are protected (the tail is the turn's end, so always the last ones)."""
        boundary = turn_len - self.protected_tail(turn_len)
        return max(0, min(chunk_len, start + chunk_len - boundary))

    def chunk_keep_counts(self, chunk_len: int, num_protected: int = 0) -> np.ndarray:
        """int64 [layers, groups] tokens kept from one chunk of `chunk_len` tokens whose last
        `num_protected` are protected, 0 <= num_protected <= chunk_len <= chunk_size, under
        ``"chunk"`` retention (under ``"turn"`` a chunk's count depends on where it lies in its
        turn: `piece_retained_counts`)."""
        if not 0 <= chunk_len <= self.chunk_size:
            raise ValueError(f"a chunk holds 0..{self.chunk_size} tokens, got {chunk_len}")
        if not 0 <= num_protected <= chunk_len:
            raise ValueError(f"num_protected must be in [0, {chunk_len}], got {num_protected}")
        if num_protected == 0:
            return self._keep_by_chunk_len[chunk_len]
        return self._keep_by_chunk_len[chunk_len - num_protected] + num_protected

    @classmethod
    def monolithic(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                   chunk_size: int, name: str = "full", tail_rule: str = "none",
                   tail_window: int = 0, retention: str = "chunk") -> "KVLayout":
        """One group of all KV heads, nothing dropped: what vLLM's PagedAttention stores."""
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   group_size=num_kv_heads, page_size=page_size, chunk_size=chunk_size,
                   head_perm=np.tile(np.arange(num_kv_heads), (num_layers, 1)),
                   group_budgets=np.ones((num_layers, 1)), name=name, tail_rule=tail_rule,
                   tail_window=tail_window, retention=retention)

    def with_tail(self, rule: str, window: int) -> "KVLayout":
        """This layout with another protected-tail rule."""
        return dataclasses.replace(self, tail_rule=rule, tail_window=window)

    def with_retention(self, retention: str, turn_view: str | None = None) -> "KVLayout":
        """This layout with another retention rule (`RETENTIONS`) and held-turn view
        (`TURN_VIEWS`; default: this layout's)."""
        return dataclasses.replace(self, retention=retention,
                                   turn_view=turn_view or self.turn_view)


# ----- precision tiers (hetero-precision KV, `tangram_jax.kv_quant`) -------------------------

# A tiered precision: the page formats of its high and low tier.
PRECISION_TIERS = {"k8v4-k4v2": ("k8v4", "k4v2")}


def tier_high_count(high_share: np.ndarray, kept: np.ndarray | int) -> np.ndarray:
    """Of `kept` tokens a group keeps from one chunk (protected ones aside), how many go to
    the high-precision tier: the top ``ceil(h * kept)`` by importance rank (at least one when
    h > 0 and kept > 0), the rest to the low tier. high_share float [..., groups] in [0, 1]."""
    h = np.asarray(high_share, dtype=np.float64)
    k = np.asarray(kept, dtype=np.int64)
    high = np.ceil(h * k - _CEIL_EPS).astype(np.int64)
    return np.clip(high, 0, k)


@dataclasses.dataclass(frozen=True, eq=False)
class TieredLayout:
    """A `KVLayout` whose retained tokens are split into precision tiers with static budgets.

    Group g of the base layout becomes two *tier groups*, ``2 g`` (high tier, `tiers[0]`'s page
    format) and ``2 g + 1`` (low tier, `tiers[1]`), each with its own pages and block table, so
    the KV-cache manager reserves per (layer, group, tier) exactly as it reserves per (layer,
    group) for a `KVLayout`: every count below is ``[layers, 2 * groups]``.

    Tier rule (the single source of truth, as `KVLayout.retained_counts` is for the totals):
    from a chunk whose unprotected part keeps k tokens, the high tier takes `tier_high_count`
    ``(h_g, k)`` of them (the top by importance within the kept set) and the low tier the rest;
    protected tail tokens and decode tokens all go to the high tier. So high + low is always
    the base layout's retained count.

    high_share: float [layers, groups] in [0, 1], the calibrated static share of the high tier
    (`BudgetProfile.tiers`).
    pool_turn: (prompt tokens, answer tokens) of the typical turn the tiers' pools are split
    for (`pool_high_share`; the engine's `kv_tier_turn`), or None: turns so long that their
    protected tails and answers do not count.
    """

    base: KVLayout
    high_share: np.ndarray
    precision: str = "k8v4-k4v2"
    pool_turn: tuple[int, int] | None = None

    def __post_init__(self):
        if not isinstance(self.base, KVLayout):
            raise TypeError(f"base must be a KVLayout, got {type(self.base).__name__}")
        if self.base.retention != "chunk":
            raise ValueError(f"precision tiers split each chunk's kept tokens by rank as the "
                             f"chunk is written: they need retention 'chunk', got "
                             f"{self.base.retention!r}")
        if self.precision not in PRECISION_TIERS:
            raise ValueError(f"precision must be one of {tuple(PRECISION_TIERS)}, got "
                             f"{self.precision!r}")
        h = np.asarray(self.high_share, dtype=np.float64)
        if h.shape != self.base.group_budgets.shape:
            raise ValueError(f"high_share has shape {h.shape}, expected "
                             f"{self.base.group_budgets.shape} [layers, groups]")
        if not (np.isfinite(h).all() and (h >= 0).all() and (h <= 1).all()):
            raise ValueError("high_share must lie in [0, 1]")
        object.__setattr__(self, "high_share", h)
        if self.pool_turn is not None:
            turn = tuple(self.pool_turn)
            if len(turn) != 2 or not all(isinstance(x, (int, np.integer)) for x in turn) or \
                    turn[0] < 1 or turn[1] < 0:
                raise ValueError(f"pool_turn must be (prompt tokens >= 1, answer tokens >= 0) or "
                                 f"None, got {self.pool_turn!r}")
            object.__setattr__(self, "pool_turn", (int(turn[0]), int(turn[1])))

    # The base layout's shape and rules, for the manager, the engine and the runner.
    num_layers = property(lambda self: self.base.num_layers)
    num_kv_heads = property(lambda self: self.base.num_kv_heads)
    head_dim = property(lambda self: self.base.head_dim)
    group_size = property(lambda self: self.base.group_size)
    head_perm = property(lambda self: self.base.head_perm)
    page_size = property(lambda self: self.base.page_size)
    chunk_size = property(lambda self: self.base.chunk_size)
    compresses = property(lambda self: self.base.compresses)
    tail_rule = property(lambda self: self.base.tail_rule)
    tail_window = property(lambda self: self.base.tail_window)
    retention = property(lambda self: self.base.retention)

    def protected_tail(self, turn_len: int) -> int:
        return self.base.protected_tail(turn_len)

    def chunk_protected(self, turn_len: int, start: int, chunk_len: int) -> int:
        return self.base.chunk_protected(turn_len, start, chunk_len)

    def with_tail(self, rule: str, window: int) -> "TieredLayout":
        """This layout with another protected-tail rule."""
        return dataclasses.replace(self, base=self.base.with_tail(rule, window))
    name = property(lambda self: f"{self.base.name}+{self.precision}")

    @property
    def tiers(self) -> tuple[str, str]:
        """Page formats (`kv_quant.KV_PRECISIONS`) of the high and the low tier."""
        return PRECISION_TIERS[self.precision]

    @property
    def num_groups(self) -> int:
        """Tier groups: two per group of the base layout."""
        return 2 * self.base.num_groups

    @property
    def pool_high_share(self) -> float:
        """The share of the pool's pages the high tier's pool gets (`pool_pages`): of the pages
        a typical sequence holds, the high tier's. The one rule: a sequence of one turn of
        `pool_turn` = (P prompt tokens, A answer tokens) holds, per (layer, tier group),
        ``pages_for(retained_counts(P) + A * decode_tier_groups)`` pages: the high tier its
        top-ranked kept tokens, the turn's whole protected tail (kept uncompressed until
        answered) and every decode token, the low tier the rest; the share is the high tier's
        sum over the sum of both. Short turns and long answers thus give the high tier more
        of the pool (without them it would fill first while low pages sit free). Without
        `pool_turn` (turns long against their tails and answers) it is the calibrated share
        of the compressed tokens, ``sum(r h) / sum(r)`` over every (layer, group) (a group of
        budget r keeps r of a turn, h of that in the high tier)."""
        if self.pool_turn is None:
            r = self.base.group_budgets
            return float((r * self.high_share).sum() / r.sum())
        prompt, answer = self.pool_turn
        pages = pages_for(self.retained_counts(prompt) + answer * self.decode_tier_groups,
                          self.page_size)
        return float(pages[:, 0::2].sum() / pages.sum())

    def pool_pages(self, usable: int) -> tuple[int, int]:
        """(high, low) pool sizes, each its null page included, of a tiered pool with `usable`
        pages to hand out: the high tier ``round(pool_high_share * usable)`` of them (at least
        one, and one left for the low tier), the low tier the rest. Pages of both tiers hold
        `page_size` tokens, so this holds the most retained tokens for `usable` pages."""
        usable = int(usable)
        if usable < 2:
            raise ValueError(f"a tiered pool needs at least 2 usable pages (one per tier), "
                             f"got {usable}")
        high = min(max(int(round(self.pool_high_share * usable)), 1), usable - 1)
        return high + 1, usable - high + 1

    @property
    def decode_tier_groups(self) -> np.ndarray:
        """bool [num_groups]: the tier groups a decode token is appended to (the high ones)."""
        return np.arange(self.num_groups) % 2 == 0

    def _interleave(self, high: np.ndarray, low: np.ndarray) -> np.ndarray:
        return np.stack([high, low], axis=-1).reshape(*high.shape[:-1], self.num_groups)

    def chunk_keep_counts(self, chunk_len: int, num_protected: int = 0) -> np.ndarray:
        """int64 [layers, 2 * groups]: `KVLayout.chunk_keep_counts` of one chunk split by the
        tier rule: the high tier takes `tier_high_count` of the unprotected part's kept tokens
        plus every protected one, the low tier the rest of the kept ones. The prefill writes
        the top ``high`` of a group's kept tokens by score to the high tier and the next
        ``low`` to the low tier (protected tokens score above every other)."""
        base = self.base
        total = base.chunk_keep_counts(chunk_len, num_protected)     # validates the arguments
        unprotected = total - num_protected
        high = tier_high_count(self.high_share, unprotected) + num_protected
        return self._interleave(high, total - high)

    def retained_counts(self, num_tokens: int, *, upto: int | None = None) -> np.ndarray:
        """int64 [layers, 2 * groups]: `KVLayout.retained_counts` split by the tier rule."""
        base = self.base
        n = int(num_tokens)
        total = base.retained_counts(n, upto=upto)           # validates n and upto
        upto = n if upto is None else int(upto)
        boundary = n - base.protected_tail(n)
        full, rest = divmod(min(upto, boundary), base.chunk_size)
        high = (full * tier_high_count(self.high_share, base.chunk_keep_counts(base.chunk_size))
                + tier_high_count(self.high_share, base.chunk_keep_counts(rest))
                + max(0, upto - boundary))
        return self._interleave(high, total - high)

    def piece_retained_counts(self, turn_len: int, start: int, end: int) -> np.ndarray:
        """`KVLayout.piece_retained_counts` per tier group."""
        return (self.retained_counts(turn_len, upto=end)
                - self.retained_counts(turn_len, upto=start))

    def segments_retained_counts(self, segments) -> np.ndarray:
        """`KVLayout.segments_retained_counts` per tier group (kept-whole segments: high)."""
        total = np.zeros((self.num_layers, self.num_groups), np.int64)
        for length, compressed in segments:
            total = total + (self.retained_counts(length) if compressed
                             else self.decode_tier_groups * int(length))
        return total

    # Tiers keep a share of each chunk as it is written (retention "chunk"): a turn never
    # holds more than it keeps.
    def peak_retained_counts(self, num_tokens: int) -> np.ndarray:
        """`KVLayout.peak_retained_counts` per tier group: the retained counts."""
        return self.retained_counts(num_tokens)

    def segments_peak_counts(self, segments) -> np.ndarray:
        """`KVLayout.segments_peak_counts` per tier group: the retained counts."""
        return self.segments_retained_counts(segments)


def check_local_layers(config, layout, mode: str, kv_precision: str,
                       max_tokens: int | None = None) -> None:
    """One clear error when a model with local (sliding-window) layers meets a layout or mode
    that would drop tokens of those layers (the module docstring, "Local layers").

    config: the `ModelConfig`; layout: a `KVLayout` or `TieredLayout`; max_tokens: the longest
    sequence served (a layer whose window is not shorter never masks anything: global)."""
    local = [i for i in getattr(config, "local_layers", ())
             if max_tokens is None or config.layer_windows[i] < max_tokens]
    if not local:
        return
    what = f"{config.architecture} has sliding-window layers {local}"
    if mode == "dynamic":
        raise ValueError(f"{what}: dynamic mode (a per-input keep count per layer) would drop "
                         f"tokens of their windows; use mode 'full' or 'tangram'")
    if kv_precision in PRECISION_TIERS:
        raise ValueError(f"{what}: kv_precision {kv_precision!r} splits a group's tokens over "
                         f"two pools by rank, and a window needs every token in place; use an "
                         f"untiered precision")
    budgets = getattr(layout, "base", layout).group_budgets
    low = [i for i in local if (budgets[i] < 1).any()]
    if low:
        raise ValueError(f"{what}: their budgets must be 1 (a local layer keeps its whole window "
                         f"and needs no compression budget), but the layout gives layers {low} "
                         f"budgets {[float(budgets[i].min()) for i in low]} (min); calibrate the "
                         f"profile again (`tangram-jax calibrate` pins local layers to 1)")
