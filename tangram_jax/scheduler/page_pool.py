"""One pool of identical KV pages serving every layer and head group.

Every page has the shape ``[G, page_size, head_dim]`` (for K and for V), so a single pool of
page ids serves all (layer, group) pairs of a `KVLayout`. The pool only hands out ids; the
device arrays ``k_pages, v_pages: [num_pages, G, page_size, head_dim]`` live with the engine.
Precision tiers (`kv_layout.TieredLayout`) store pages of two formats: the KV-cache manager
keeps a `PagePool` per tier, each the ids of its tier's arrays.

Page 0 is the *null page*: it is never handed out. Unused block-table entries are 0 and padded
decode rows point at it, so a kernel that reads an unused entry stays in range and a padded row's
KV write lands on a page that no sequence owns.

Pages are reference-counted: the `n` completions of one request fork the prompt's pages
(`KVCacheManager.fork`), so one page may sit in several block tables. `share` adds a holder,
`release` drops one, and a page returns to the free stack when its last holder lets it go.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """The pool cannot serve an allocation (callers check `num_free` first on the hot path)."""


class PagePool:
    """A free stack of reference-counted page ids, allocated and released many at a time.

    The free ids sit in one int32 array used as a stack (``_free[:_num_free]``), so allocating or
    releasing k pages is one slice copy, not k Python operations. `_refs` (holders per page, 0:
    free) guards against double frees and foreign ids at the cost of one vectorized check per
    call.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)):
            raise TypeError(f"num_pages must be an int, got {num_pages!r}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = int(num_pages)
        self._refs = np.zeros(self.num_pages, dtype=np.int32)
        self._position = np.zeros(self.num_pages, dtype=np.int32)   # scratch for release()
        self.limit(self.num_pages)

    def limit(self, num_pages: int) -> None:
        """Hand out only ids below `num_pages` (<= the pool's size) from now on: a pool of that
        size over the same arrays. Every page is free again after the change, so none may be
        allocated. (A benchmark sweeping the pool's size keeps the compiled programs of the
        largest; the pages' arrays do not change.)"""
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                or not 2 <= num_pages <= self.num_pages:
            raise ValueError(f"num_pages must be an int in [2, {self.num_pages}], got "
                             f"{num_pages!r}")
        if self._refs.any():
            raise ValueError(f"limiting the pool with {int((self._refs > 0).sum())} pages "
                             f"allocated: free them first")
        self.usable_pages = int(num_pages)
        # Low ids on top of the stack so a fresh pool hands out 1, 2, 3, ... (easier to read).
        self._free = np.zeros(self.num_pages, dtype=np.int32)
        self._free[:self.usable_pages - 1] = np.arange(self.usable_pages - 1, 0, -1)
        self._num_free = self.usable_pages - 1

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page; below `limit`)."""
        return self.usable_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    def allocate(self, n: int) -> np.ndarray:
        """Take `n` pages, all or nothing. Returns int32 ``[n]`` page ids."""
        n = int(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._num_free:
            raise OutOfPagesError(f"asked for {n} pages, {self._num_free} free")
        top = self._num_free
        pages = self._free[top - n:top][::-1].copy()
        self._num_free = top - n
        # intp indices: numpy scatters/gathers with them about twice as fast as with int32.
        self._refs[pages.astype(np.intp)] = 1
        return pages

    def share(self, pages: np.ndarray) -> None:
        """Add a holder to each of `pages` (distinct, allocated): a forked block table now
        points at them too. Each holder gives its reference back with `release`."""
        pages = np.asarray(pages, dtype=np.int32).ravel()
        if pages.size == 0:
            return
        index = self._checked_index(pages, "sharing")
        self._refs[index] += 1

    def release(self, pages: np.ndarray, *, distinct: bool = False) -> None:
        """Drop one reference to each of `pages`; those left without holders are free again.
        Raises ValueError on the null page, foreign ids or double frees.

        distinct: the caller guarantees no id repeats within `pages` (the KV-cache manager's
        pages come from a block table, each entry allocated once), which skips the O(k)
        within-call duplicate check; ids not allocated are refused either way.
        """
        pages = np.asarray(pages, dtype=np.int32).ravel()
        if pages.size == 0:
            return
        index = self._checked_index(pages, "releasing")
        if not distinct:
            # Duplicate check in O(k): after scattering positions, a repeated id reads back the
            # position of its last occurrence at its first one.
            order = np.arange(pages.size, dtype=np.int32)
            self._position[index] = order
            if (self._position.take(index) != order).any():
                raise ValueError("releasing a page that is not allocated (double free)")
        self._refs[index] -= 1
        freed = pages[self._refs.take(index) == 0]
        top = self._num_free
        self._free[top:top + freed.size] = freed[::-1]
        self._num_free = top + freed.size

    def _checked_index(self, pages: np.ndarray, doing: str) -> np.ndarray:
        """intp ids of `pages` after checking each is a handed-out page (not the null page)."""
        if pages.min() <= NULL_PAGE or pages.max() >= self.num_pages:
            raise ValueError(f"page ids must lie in [1, {self.num_pages}), got "
                             f"[{pages.min()}, {pages.max()}]")
        index = pages.astype(np.intp)
        if not (self._refs.take(index) > 0).all():
            raise ValueError(f"{doing} a page that is not allocated (double free)")
        return index

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        """bool array: which of `pages` are currently handed out."""
        return self._refs[np.asarray(pages, dtype=np.intp)] > 0

    def holders(self, pages: np.ndarray) -> np.ndarray:
        """int32 array: how many block tables (or stashes) hold each of `pages` (0: free)."""
        return self._refs[np.asarray(pages, dtype=np.intp)]
