"""Block tables: which pages hold each (sequence slot, layer, group)'s retained tokens.

Host-side numpy arrays the device consumes every step:

    tables:    int32 [rows, layers, groups, max_pages]   page ids, unused entries 0 (null page)
    num_pages: int32 [rows, layers, groups]              how many entries of each row are in use

Entries ``tables[s, l, g, :num_pages[s, l, g]]`` are the pages in token order; the rest are 0.
Every update is a whole-array numpy operation over all (slot, layer, group) cells it touches:
no Python loop over layers, groups or pages.

Every write is also appended to an update log (flat index into ``tables.ravel()``, new value), so
an engine that keeps a device-resident copy of the table can apply only what changed since the
last step (`take_updates`) instead of copying ``rows * layers * groups * max_pages`` entries.
"""

from __future__ import annotations

import numpy as np


class BlockTableFullError(RuntimeError):
    """A (slot, layer, group) would need more than `max_pages` pages."""


class BlockTable:
    def __init__(self, num_rows: int, num_layers: int, num_groups: int, max_pages: int):
        if min(num_rows, num_layers, num_groups, max_pages) <= 0:
            raise ValueError("block table dimensions must be positive, got "
                             f"{(num_rows, num_layers, num_groups, max_pages)}")
        self.max_pages = int(max_pages)
        self.tables = np.zeros((num_rows, num_layers, num_groups, max_pages), dtype=np.int32)
        self.num_pages = np.zeros((num_rows, num_layers, num_groups), dtype=np.int32)
        self.cells_per_row = num_layers * num_groups
        self.row_size = self.cells_per_row * self.max_pages   # table entries per slot
        self._cell_starts = np.arange(self.cells_per_row, dtype=np.int64) * self.max_pages
        self._log_index: list[np.ndarray] = []
        self._log_value: list[np.ndarray] = []

    def append(self, slots: np.ndarray, counts: np.ndarray, pages: np.ndarray) -> None:
        """Append pages to many cells at once.

        slots: int [n] distinct rows; counts: int [n, layers, groups] pages added per cell;
        pages: int32 [counts.sum()] ids, consumed cell by cell in C order of
        (slot, layer, group) and in token order within a cell.
        """
        slots = np.asarray(slots, dtype=np.intp)
        counts = np.asarray(counts)
        pages = np.asarray(pages, dtype=np.int32)
        if counts.shape != (slots.size,) + self.num_pages.shape[1:]:
            raise ValueError(f"counts has shape {counts.shape}, expected "
                             f"{(slots.size,) + self.num_pages.shape[1:]} [slots, layers, groups]")
        if pages.size != counts.sum():
            raise ValueError(f"{pages.size} pages given for {counts.sum()} entries")
        if pages.size == 0:
            return
        if counts.min() < 0:
            raise ValueError("counts must be >= 0")
        held = self.num_pages[slots]
        new_held = held + counts
        if new_held.max() > self.max_pages:
            raise BlockTableFullError(f"a group would need {new_held.max()} pages, "
                                      f"the table holds {self.max_pages}")
        flat_index = self._entries(slots, counts, first=held)
        self.tables.reshape(-1)[flat_index] = pages
        self.num_pages[slots] = new_held
        self._log(flat_index, pages)

    def append_to_cells(self, cells: np.ndarray, pages: np.ndarray, *,
                        columns: np.ndarray | None = None) -> None:
        """Append ``pages[i]`` to global cell ``cells[i]`` (distinct cells; a cell is
        ``(slot * layers + layer) * groups + group``). The decode hot path: it touches only the
        cells that grow, never the whole batch.

        columns: ``num_pages.ravel()[cells]``, if the caller has already read it and checked
        that every one is below `max_pages`."""
        pages = np.asarray(pages, dtype=np.int32)
        if pages.size != cells.size:
            raise ValueError(f"{pages.size} pages given for {cells.size} cells")
        if cells.size == 0:
            return
        num_pages = self.num_pages.reshape(-1)
        col = columns
        if col is None:
            col = num_pages[cells]
            if col.max() >= self.max_pages:
                raise BlockTableFullError(f"a group would need {col.max() + 1} pages, "
                                          f"the table holds {self.max_pages}")
        flat_index = np.asarray(cells, dtype=np.int64) * self.max_pages + col
        self.tables.reshape(-1)[flat_index] = pages
        num_pages[cells] = col + 1
        self._log(flat_index, pages)

    def truncate(self, slots: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Cut every cell of `slots` down to `keep` pages; return the dropped page ids.

        slots: int [n] distinct rows; keep: int [n, layers, groups] (cells already at or below
        their `keep` are untouched). Returned ids are in C order of (slot, layer, group, page).
        """
        slots = np.asarray(slots, dtype=np.intp)
        held = self.num_pages[slots]
        new_held = np.minimum(held, keep)
        flat_index = self._entries(slots, held - new_held, first=new_held)
        released = self._clear_entries(flat_index)
        self.num_pages[slots] = new_held
        return released

    def clear(self, slot: int) -> np.ndarray:
        """Empty one row; return the page ids it held (C order of layer, group, page)."""
        released = self._clear_entries(self._entries(np.array([slot], dtype=np.intp),
                                                     self.num_pages[slot]))
        self.num_pages[slot] = 0
        return released

    def pages_of(self, slot: int) -> np.ndarray:
        """All page ids row `slot` holds (C order of layer, group, page)."""
        return self.tables.reshape(-1)[self._entries(np.array([slot], dtype=np.intp),
                                                     self.num_pages[slot])]

    def _entries(self, slots: np.ndarray, counts: np.ndarray,
                  first: np.ndarray | None = None) -> np.ndarray:
        """int64 flat indices into ``tables.ravel()`` of columns ``first .. first + counts - 1``
        (first None: from column 0) of every cell of `slots`, in C order of (slot, layer, group,
        column).

        slots: intp [n]; counts, first: int [n, layers, groups] (or [layers, groups] for one
        slot), counts >= 0. One ragged arange (a repeat and an arange over the entries): no loop
        over cells."""
        counts = counts.reshape(-1)
        ends = np.cumsum(counts)
        total = int(ends[-1]) if ends.size else 0
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        cell_start = (slots[:, None] * self.row_size + self._cell_starts).reshape(-1) - ends
        cell_start += counts if first is None else counts + first.reshape(-1)
        entries = np.repeat(cell_start, counts)
        entries += np.arange(total)
        return entries

    def _clear_entries(self, flat_index: np.ndarray) -> np.ndarray:
        """Zero the given entries (logged); return the page ids they held."""
        flat = self.tables.reshape(-1)
        released = flat[flat_index]
        if flat_index.size:
            flat[flat_index] = 0
            self._log(flat_index, np.zeros(flat_index.size, dtype=np.int32))
        return released

    def take_updates(self) -> tuple[np.ndarray, np.ndarray]:
        """Writes since the last call: (int64 flat indices into ``tables.ravel()``, int32 values).

        Applying them in order to a copy of the table taken at the previous call reproduces the
        current table (later writes to the same index win).
        """
        if not self._log_index:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        index = np.concatenate(self._log_index)
        value = np.concatenate(self._log_value)
        self._log_index.clear()
        self._log_value.clear()
        return index, value

    def _log(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        self._log_index.append(np.asarray(flat_index, dtype=np.int64))
        self._log_value.append(np.asarray(values, dtype=np.int32))
