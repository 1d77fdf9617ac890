"""Vectorized page-pool and block-table operations against naive per-entry oracles."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_jax.scheduler.block_table import BlockTable, BlockTableFullError
from tangram_jax.scheduler.page_pool import OutOfPagesError, PagePool

ROWS, LAYERS, GROUPS, MAX_PAGES = 4, 3, 2, 6


class OracleTable:
    """One Python list of page ids per (row, layer, group)."""

    def __init__(self):
        self.cells = {(s, l, g): [] for s in range(ROWS) for l in range(LAYERS)
                      for g in range(GROUPS)}

    def append(self, slots, counts, pages):
        it = iter(pages.tolist())
        for i, s in enumerate(slots):
            for l in range(LAYERS):
                for g in range(GROUPS):
                    for _ in range(counts[i, l, g]):
                        self.cells[(s, l, g)].append(next(it))

    def truncate(self, slots, keep):
        dropped = []
        for i, s in enumerate(slots):
            for l in range(LAYERS):
                for g in range(GROUPS):
                    cell = self.cells[(s, l, g)]
                    dropped += cell[keep[i, l, g]:]
                    del cell[keep[i, l, g]:]
        return dropped

    def dense(self):
        tables = np.zeros((ROWS, LAYERS, GROUPS, MAX_PAGES), dtype=np.int32)
        counts = np.zeros((ROWS, LAYERS, GROUPS), dtype=np.int32)
        for (s, l, g), cell in self.cells.items():
            tables[s, l, g, :len(cell)] = cell
            counts[s, l, g] = len(cell)
        return tables, counts


ops = st.lists(st.tuples(st.sampled_from(["append", "append_to_cells", "truncate", "clear"]),
                         st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS, unique=True),
                         st.integers(0, 2**31 - 1)), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_block_table_matches_per_entry_oracle(operations):
    pool = PagePool(ROWS * LAYERS * GROUPS * MAX_PAGES + 1)
    table, oracle = BlockTable(ROWS, LAYERS, GROUPS, MAX_PAGES), OracleTable()
    device = table.tables.copy()
    for kind, slots, seed in operations:
        rng = np.random.default_rng(seed)
        slots = np.array(slots)
        held = table.num_pages[slots]
        if kind == "append":
            counts = rng.integers(0, MAX_PAGES - held + 1)
            pages = pool.allocate(int(counts.sum()))
            table.append(slots, counts, pages)
            oracle.append(slots, counts, pages)
        elif kind == "append_to_cells":
            mask = (rng.random(held.shape) < 0.5) & (held < MAX_PAGES)
            pages = pool.allocate(int(mask.sum()))
            i, layer, group = np.nonzero(mask)
            table.append_to_cells((slots[i] * LAYERS + layer) * GROUPS + group, pages)
            oracle.append(slots, mask.astype(int), pages)
        elif kind == "truncate":
            keep = rng.integers(0, MAX_PAGES + 1, size=held.shape)
            got = table.truncate(slots, keep)
            want = oracle.truncate(slots, np.minimum(keep, held))
            assert got.tolist() == want
            pool.release(got)
        else:
            got = table.clear(int(slots[0]))
            assert got.tolist() == oracle.truncate(slots[:1], np.zeros((1, LAYERS, GROUPS), int))
            pool.release(got)
        tables, counts = oracle.dense()
        np.testing.assert_array_equal(table.tables, tables)
        np.testing.assert_array_equal(table.num_pages, counts)
        for s in range(ROWS):
            assert sorted(table.pages_of(s).tolist()) == sorted(
                p for (r, _, _), cell in oracle.cells.items() if r == s for p in cell)
        index, value = table.take_updates()
        device.reshape(-1)[index] = value
        np.testing.assert_array_equal(device, table.tables)
    owned = table.tables[table.tables > 0]
    assert pool.num_free + owned.size == pool.capacity


def test_block_table_refuses_overflow_and_bad_shapes():
    table = BlockTable(ROWS, LAYERS, GROUPS, MAX_PAGES)
    with pytest.raises(BlockTableFullError):
        table.append(np.array([0]), np.full((1, LAYERS, GROUPS), MAX_PAGES + 1),
                     np.arange(1, LAYERS * GROUPS * (MAX_PAGES + 1) + 1))
    with pytest.raises(ValueError, match="counts has shape"):
        table.append(np.array([0]), np.ones((LAYERS, GROUPS), int), np.arange(1, 7))
    with pytest.raises(ValueError, match="pages given"):
        table.append(np.array([0]), np.ones((1, LAYERS, GROUPS), int), np.arange(1, 3))
    counts = np.zeros((1, LAYERS, GROUPS), int)
    counts[0, 0, :2] = [2, -1]
    with pytest.raises(ValueError, match=">= 0"):
        table.append(np.array([0]), counts, np.arange(1, 2))


def test_page_pool_all_or_nothing_and_double_free():
    pool = PagePool(8)
    assert pool.capacity == 7 and pool.num_free == 7
    pages = pool.allocate(5)
    assert pages.dtype == np.int32 and sorted(pages.tolist()) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfPagesError):
        pool.allocate(3)
    assert pool.num_free == 2                       # the failed call took nothing
    pool.release(pages[:2])
    with pytest.raises(ValueError, match="double free"):
        pool.release(pages[:1])
    with pytest.raises(ValueError, match="page ids"):
        pool.release(np.array([0]))
    with pytest.raises(ValueError, match="double free"):
        pool.release(np.array([pages[3], pages[3]]))
    assert pool.num_free == 4
    # distinct=True (pages from a block table) skips only the within-call duplicate scan:
    # ids that are not allocated are still refused, and a refused call changes nothing.
    with pytest.raises(ValueError, match="double free"):
        pool.release(pages[:1], distinct=True)
    pool.release(pages[2:4], distinct=True)
    assert pool.num_free == 6 and not pool.is_allocated(pages[2:4]).any()
    with pytest.raises(ValueError):
        PagePool(1)
