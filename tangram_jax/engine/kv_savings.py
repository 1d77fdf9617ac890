"""What the cached KV saved against full KV, and why, in words a user reads (`run`, `chat`).

Compression acts on a turn's prompt tokens only, chunk by chunk, and keeps every turn's
protected tail whole (`kv_layout`: the question the model has not answered yet); the tokens a
decode step writes (the answers) are kept whole too. So a conversation of short messages and
long answers holds as much as full KV, and `describe` says so instead of printing two equal
numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class TokenBreakdown:
    """Where the cached tokens of some sequences came from.

    compressible: prompt tokens outside their turn's protected tail (what chunked compression
    thins out); protected: prompt tokens in protected tails; generated: tokens decode wrote;
    turns / longest_turn: prompt turns and the longest one's tokens.
    """

    compressible: int = 0
    protected: int = 0
    generated: int = 0
    turns: int = 0
    longest_turn: int = 0

    @property
    def tokens(self) -> int:
        return self.compressible + self.protected + self.generated


def token_breakdown(sequences: Iterable, layout) -> TokenBreakdown:
    """The cached tokens of `sequences` (scheduler `Sequence`s: `num_computed_tokens`, `turns`)
    split by how `layout`'s retention rule treats them."""
    compressible = protected = generated = turns = longest = 0
    for seq in sequences:
        cached = seq.num_computed_tokens
        in_turns = 0
        for start, end in seq.turns:
            n = max(0, min(end, cached) - start)
            if n == 0:
                continue
            tail = min(n, layout.protected_tail(end - start))
            protected += tail
            compressible += n - tail
            in_turns += n
            turns += 1
            longest = max(longest, end - start)
        generated += cached - in_turns
    return TokenBreakdown(compressible, protected, generated, turns, longest)


def saving_line(held_bytes: int, full_bytes: int) -> str:
    """"KV held 72.8 MiB, 15.2% less than full KV's 85.8 MiB" (or "the same as" / "more than")."""
    held, full = held_bytes / MIB, full_bytes / MIB
    if held_bytes < full_bytes:
        return (f"KV held {held:.1f} MiB, {100 * (1 - held_bytes / full_bytes):.1f}% less than "
                f"full KV's {full:.1f} MiB")
    if held_bytes == full_bytes:
        return f"KV held {held:.1f} MiB, the same as full KV's {full:.1f} MiB"
    return f"KV held {held:.1f} MiB, more than full KV's {full:.1f} MiB (partly filled pages)"


def tail_words(layout) -> str:
    """The protected tail of a turn, in words."""
    if layout.tail_rule == "window":
        return f"a turn's last {layout.tail_window} tokens"
    if layout.tail_rule == "final_chunk":
        return f"a turn's final chunk (up to {layout.chunk_size} tokens)"
    return "nothing"


def describe(held_bytes: int, full_bytes: int, breakdown: TokenBreakdown, layout,
             mode: str) -> str:
    """One sentence: what was saved, and where the tokens came from; when nothing was saved,
    why."""
    b = breakdown
    line = saving_line(held_bytes, full_bytes)
    if b.tokens == 0:
        return f"{line} (nothing cached)"
    if held_bytes < full_bytes:
        return (f"{line} for the same {b.tokens:,} tokens ({b.compressible:,} compressible "
                f"prompt tokens, {b.protected:,} in protected turn tails, {b.generated:,} "
                f"generated)")
    if mode == "full":
        return f"{line}: full mode keeps every token"
    kept_whole = (f"protected tail ({tail_words(layout)}, kept whole until answered), and the "
                  f"{b.generated:,} generated tokens are written by decode, which keeps every "
                  f"token")
    if b.compressible == 0:
        return (f"{line}: nothing was compressed. Compression thins a turn's prompt outside its "
                f"{kept_whole}; every turn so far ({b.turns}, at most {b.longest_turn} tokens) "
                f"fits in its tail. Longer messages have tokens to compress")
    return (f"{line}: only {b.compressible:,} of the {b.tokens:,} tokens were compressible "
            f"prompt tokens, too few to free a page of {layout.page_size}. Compression thins a "
            f"turn's prompt outside its {kept_whole}")
