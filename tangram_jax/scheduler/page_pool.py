"""One pool of identical KV pages serving every layer and head group.

Every page has the shape ``[G, page_size, head_dim]`` (for K and for V), so a single pool of
page ids serves all (layer, group) pairs of a `KVLayout`. The pool only hands out ids; the
device arrays ``k_pages, v_pages: [num_pages, G, page_size, head_dim]`` live with the engine.

Page 0 is the *null page*: it is never handed out. Unused block-table entries are 0 and padded
decode rows point at it, so a kernel that reads an unused entry stays in range and a padded row's
KV write lands on a page that no sequence owns.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """The pool cannot serve an allocation (callers check `num_free` first on the hot path)."""


class PagePool:
    """A free stack of page ids, allocated and released many at a time.

    The free ids sit in one int32 array used as a stack (``_free[:_num_free]``), so allocating or
    releasing k pages is one slice copy, not k Python operations. `_in_use` guards against double
    frees and foreign ids at the cost of one vectorized check per call.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)):
            raise TypeError(f"num_pages must be an int, got {num_pages!r}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = int(num_pages)
        # Low ids on top of the stack so a fresh pool hands out 1, 2, 3, ... (easier to read).
        self._free = np.arange(self.num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = self.num_pages - 1
        self._in_use = np.zeros(self.num_pages, dtype=bool)
        self._position = np.zeros(self.num_pages, dtype=np.int32)   # scratch for release()

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

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
        self._in_use[pages.astype(np.intp)] = True
        return pages

    def release(self, pages: np.ndarray, *, distinct: bool = False) -> None:
        """Give pages back. Raises ValueError on the null page, foreign ids or double frees.

        distinct: the caller guarantees no id repeats within `pages` (the KV-cache manager's
        pages come from a block table, each entry allocated once), which skips the O(k)
        within-call duplicate check; ids not allocated are refused either way.
        """
        pages = np.asarray(pages, dtype=np.int32).ravel()
        if pages.size == 0:
            return
        if pages.min() <= NULL_PAGE or pages.max() >= self.num_pages:
            raise ValueError(f"page ids must lie in [1, {self.num_pages}), got "
                             f"[{pages.min()}, {pages.max()}]")
        index = pages.astype(np.intp)
        if not self._in_use.take(index).all():
            raise ValueError("releasing a page that is not allocated (double free)")
        if not distinct:
            # Duplicate check in O(k): after scattering positions, a repeated id reads back the
            # position of its last occurrence at its first one.
            order = np.arange(pages.size, dtype=np.int32)
            self._position[index] = order
            if (self._position.take(index) != order).any():
                raise ValueError("releasing a page that is not allocated (double free)")
        self._in_use[index] = False
        top = self._num_free
        self._free[top:top + pages.size] = pages[::-1]
        self._num_free = top + pages.size

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        """bool array: which of `pages` are currently handed out."""
        return self._in_use[np.asarray(pages, dtype=np.intp)]
