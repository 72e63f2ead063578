"""SGLang's token-level KV indexing: the other end of the block-size axis.

vLLM indexes KV memory per block: a request's row in the block table holds one
int32 per block. SGLang (Zheng et al., 2023) indexes it per token, in two
levels:

- ``ReqToTokenPool.req_to_token[req, pos]`` is the KV slot of token ``pos`` of
  request ``req``: one int32 per token of the context window, for every
  request row. Row 0 is padding: a padded batch points its dummy requests at
  row 0, so their reads and writes land somewhere harmless.
- ``TokenToKVPoolAllocator`` hands out those slots one token at a time from a
  free list kept as a tensor (allocation is a slice, freeing a concatenation).
  Slot 0 is reserved: padded tokens write their dummy K/V there. Frees go
  to the tail and the list is never sorted, so reuse follows the order of
  frees: SGLang 0.5.23's default. Only with ``need_sort`` (which SGLang turns
  on for prefill/decode disaggregation alone) does it park frees in a second
  list and ``merge_and_sort_free`` them back in address order when an
  allocation runs short; we leave that mode out.
- ``PagedTokenToKVPoolAllocator`` hands them out a page at a time but still
  returns one slot per token, so ``req_to_token`` stays token-level. A prefill
  that extends a prefix must then (1) fill the rest of the prefix's partial
  last page, (2) take whole new pages, (3) start a partial final page:
  ``alloc_extend``'s three cases, which vLLM never needs because its table is
  the page list itself. ``free`` releases the pages under some slots in page
  order (``torch.unique`` sorts them) to the head of the free list;
  ``free_segment``, which SGLang's radix cache uses for one request's run of
  slots, keeps the request's page order instead.

This is our code with SGLang 0.5.23's names and semantics. To make ``check()``
possible (free and allocated must partition the pool; nothing is handed out
twice) each allocator also keeps a boolean "allocated" mask beside its free
list; SGLang trusts its callers instead.
"""

from __future__ import annotations

import numbers

import torch

from ._device import default_device
from .common import InvariantError, cdiv, check_int, require

__all__ = ["ReqToTokenPool", "TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"]




_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1
_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _flat_items(x, prefix: str):
    """(``name[i][j]...``, value) for every scalar of a nested list/tuple/array, in order."""
    if isinstance(x, (list, tuple)) or (hasattr(x, "__len__") and hasattr(x, "__getitem__")
                                        and not isinstance(x, (str, bytes, torch.Tensor)) and getattr(x, "ndim", 1)):
        for i, item in enumerate(x):
            yield from _flat_items(item, f"{prefix}[{i}]")
    else:
        yield prefix, x


def _as_int_tensor(x, name: str) -> torch.Tensor:
    """``torch.as_tensor(x)``, but a value torch cannot take becomes an error that names it."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(x)
        except (OverflowError, RuntimeError, TypeError, ValueError):
            # Find the culprit: torch's own message ("Overflow when unpacking long") names neither.
            for where, v in _flat_items(x, name):
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise TypeError(f"{where} = {v!r} is not an integer") from None
                if not _INT64_MIN <= v <= _INT64_MAX:
                    raise ValueError(f"{where} = {v} does not fit in int64") from None
            raise TypeError(f"{name} must be a sequence of integers, got {type(x).__name__} {x!r}") from None
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; pass real indices")
    return t


def _index_tensor(x, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a tensor, array or sequence of ints (for validation)."""
    t = _as_int_tensor(x, name)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64)


class ReqToTokenPool:
    """``req_to_token``: ``[size + 1, max_context_len]`` int32, the KV slot of every token of every request.

    Rows ``1..size`` are handed to requests by ``alloc``; row 0 is the padding
    row and is never handed out.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str | None = None):
        self.size = check_int(size, "size", 1)
        self.max_context_len = check_int(max_context_len, "max_context_len", 1)
        self.device = torch.device(device) if device is not None else default_device()
        # +1 for the padding row 0.
        self.req_to_token = torch.zeros((self.size + 1, self.max_context_len), dtype=torch.int32, device=self.device)
        self.clear()

    def clear(self) -> None:
        self.free_slots: list[int] = list(range(1, self.size + 1))
        self._allocated: set[int] = set()

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        """``need_size`` free rows, or None (and no change) when fewer are free.

        Rows come from the tail of the free list, as in SGLang 0.5.23
        (``alloc_rows``): popping the tail costs O(need_size) where slicing
        the head would copy the whole list. A fresh pool of 8 rows hands out
        row 8 first, and a freed row (appended at the tail) is reused next.
        """
        n = check_int(need_size, "need_size", 0)
        if n > len(self.free_slots):
            return None
        split = len(self.free_slots) - n  # n == 0 takes nothing ([-0:] would take all)
        rows = self.free_slots[split:]
        del self.free_slots[split:]
        self._allocated.update(rows)
        return rows

    def free(self, free_index: int | list[int]) -> None:
        """Return rows to the pool. Every row must be allocated, and listed once."""
        rows = [free_index] if isinstance(free_index, numbers.Integral) else list(free_index)
        for r in rows:
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise TypeError(f"request rows are ints, got {type(r).__name__} {r!r}")
            if r not in self._allocated:
                what = "the padding row" if r == 0 else "not allocated" if 1 <= r <= self.size else "out of range"
                raise ValueError(f"cannot free request row {r}: {what}")
        if len(set(rows)) != len(rows):
            dup = next(r for r in rows if rows.count(r) > 1)
            raise ValueError(f"request row {dup} appears twice in one free()")
        self.free_slots.extend(int(r) for r in rows)
        self._allocated.difference_update(rows)

    def write(self, indices: tuple[int, slice], values) -> None:
        """``req_to_token[indices] = values`` for an allocated row, as SGLang's ``write``.

        ``values`` are KV slot ids: integers (a tensor of an integer dtype, or a
        sequence of ints) in ``0..2**31 - 1``, since the table is int32. Floats,
        bools, negative ids and ids the table cannot hold are refused (the
        table's cast would truncate or wrap them silently); nothing is written
        unless every value is valid.
        """
        try:
            row, cols = indices
        except (TypeError, ValueError):
            raise TypeError(f"indices must be (row, slice), got {indices!r}") from None
        if isinstance(row, bool) or not isinstance(row, numbers.Integral) or row not in self._allocated:
            raise ValueError(f"cannot write request row {row!r}: not an allocated row")
        if not isinstance(cols, slice):
            raise TypeError(f"columns must be a slice, got {type(cols).__name__}")
        start, stop, step = cols.indices(self.max_context_len)
        if step != 1 or (cols.stop is not None and cols.stop > self.max_context_len):
            raise IndexError(f"columns {cols} fall outside the context window of {self.max_context_len}")
        vals = _as_int_tensor(values, "values")
        if vals.numel() and (vals.dtype == torch.bool or vals.is_floating_point() or vals.is_complex()):
            raise TypeError(f"values must be integer slot ids, got dtype {vals.dtype}")
        if vals.dim() > 1:
            raise ValueError(f"values must be 1-D, got shape {tuple(vals.shape)}")
        if vals.numel() != max(stop - start, 0):
            raise ValueError(f"{vals.numel()} values for {max(stop - start, 0)} columns {cols}")
        if vals.numel():
            flat = vals.reshape(-1).cpu()
            if flat.dtype in _WIDE_UNSIGNED:  # torch compares these poorly; they are rare: check in Python
                bad_at = [i for i, v in enumerate(flat.tolist()) if v > _INT32_MAX]
            else:
                bad = (flat < 0) | (flat.to(torch.int64) > _INT32_MAX)
                bad_at = bad.nonzero()[:, 0].tolist() if bool(bad.any()) else []
            if bad_at:
                i = bad_at[0]
                raise ValueError(f"values[{i}] = {flat[i].item()} is not a slot id the int32 table can hold "
                                 f"(must be in 0..{_INT32_MAX})")
        self.req_to_token[row, start:stop] = vals.to(self.device, torch.int32)

    @property
    def metadata_bytes(self) -> int:
        """Bytes of ``req_to_token``, padding row included."""
        return self.req_to_token.numel() * self.req_to_token.element_size()

    def check(self) -> None:
        """Free and allocated rows partition 1..size; row 0 is in neither (``InvariantError`` if not)."""
        free = self.free_slots
        require(len(set(free)) == len(free), "no row is free twice", "free_slots has duplicates")
        require(not set(free) & self._allocated, "a row is never both free and allocated",
                lambda: f"rows {sorted(set(free) & self._allocated)}")
        require(set(free) | self._allocated == set(range(1, self.size + 1)), "free and allocated rows cover exactly 1..size",
                "a row is missing, or row 0 (padding) is listed")


def _check_free_partition(free: torch.Tensor, allocated: torch.Tensor, n: int, unit: str) -> None:
    """The allocators' shared invariant, over units (slots or pages) 1..n; unit 0 is padding.

    No unit is free twice; free and allocated are disjoint and together cover
    1..n; unit 0 is in neither. Raises ``InvariantError`` naming the broken rule.
    """
    require(not free.numel() or (int(free.min()) >= 1 and int(free.max()) <= n), f"free {unit}s lie in 1..{n}",
            lambda: f"found {free.min().item()}..{free.max().item()}")
    require(torch.unique(free).numel() == free.numel(), f"no {unit} is free twice", "the free list has duplicates")
    require(not allocated[0], f"{unit} 0 (padding) is never allocated", f"{unit} 0 is marked allocated")
    require(not allocated[free].any(), f"a {unit} is never both free and allocated",
            lambda: f"{unit}s {free[allocated[free]].tolist()}")
    require(free.numel() + int(allocated.sum()) == n, f"free and allocated cover every {unit}",
            lambda: f"{free.numel()} free + {int(allocated.sum())} allocated != {n}")


class TokenToKVPoolAllocator:
    """Hands out KV slots one token at a time: slots ``1..size``; slot 0 is the padding slot.

    The free list is an int64 tensor: ``alloc(n)`` slices its head, ``free``
    appends at its tail, so slots are reused in the order they were freed.
    """

    page_size = 1

    def __init__(self, size: int, device: torch.device | str | None = None):
        self.size = check_int(size, "size", 1)
        self.device = torch.device(device) if device is not None else default_device()
        self.clear()

    def clear(self) -> None:
        # Slot 0 is never free: padded tokens write their dummy K/V there.
        self.free_pages = 1 + torch.arange(self.size, dtype=torch.int64, device=self.device)
        self._allocated = torch.zeros(self.size + 1, dtype=torch.bool)

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots as an int64 tensor, or None (and no change) when short."""
        n = check_int(need_size, "need_size", 0)
        if n > len(self.free_pages):
            return None
        select, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self._allocated[select.cpu()] = True
        return select

    def free(self, free_index) -> None:
        """Return slots to the pool. Each must be allocated and listed once."""
        idx = _index_tensor(free_index, "free_index")
        if idx.numel() == 0:
            return
        bad = (idx < 1) | (idx > self.size)
        if bool(bad.any()):
            v = int(idx[bad][0])
            raise ValueError(f"cannot free slot {v}: " + ("slot 0 is the padding slot" if v == 0 else f"outside 1..{self.size}"))
        not_held = ~self._allocated[idx]
        if bool(not_held.any()):
            raise ValueError(f"cannot free slot {int(idx[not_held][0])}: it is not allocated (double free?)")
        uniq, counts = torch.unique(idx, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"slot {int(uniq[counts > 1][0])} appears twice in one free()")
        self._allocated[idx] = False
        self.free_pages = torch.cat((self.free_pages, idx.to(self.device)))

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """Free one request's slots ``kv_row[start_pos : start_pos + n]``.

        With one slot a page every start is page-aligned and ``free`` already
        keeps the given order, so this is ``free``, as in SGLang.
        """
        check_int(start_pos, "start_pos", 0)
        self.free(free_index)

    def check(self) -> None:
        """No slot is free twice; free and allocated partition 1..size; slot 0 is in neither."""
        _check_free_partition(self.free_pages.cpu(), self._allocated, self.size, "slot")


class PagedTokenToKVPoolAllocator:
    """Hands out whole pages of ``page_size`` slots but returns one slot per token.

    Page ``p`` owns slots ``[p * page_size, (p + 1) * page_size)``; pages
    ``1..num_pages`` are allocatable and page 0 is the padding page. A token
    at position ``pos`` of a request always sits at offset ``pos % page_size``
    of its page, which is what lets a page-based attention kernel read the
    request's slots as pages.
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str | None = None):
        self.size = check_int(size, "size", 1)
        self.page_size = check_int(page_size, "page_size", 1)
        self.num_pages = self.size // self.page_size
        if self.num_pages < 1:
            raise ValueError(f"size {size} holds no whole page of {page_size} slots")
        self.device = torch.device(device) if device is not None else default_device()
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool)  # by page

    def available_size(self) -> int:
        """Free slots (whole free pages times page_size)."""
        return len(self.free_pages) * self.page_size

    def _take_pages(self, n: int) -> torch.Tensor:
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self._allocated[pages.cpu()] = True
        return pages.cpu()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots filling whole pages (need_size must be a multiple of page_size)."""
        n = check_int(need_size, "need_size", 0)
        if n % self.page_size:
            raise ValueError(f"need_size {n} is not a multiple of page_size {self.page_size}")
        if n // self.page_size > len(self.free_pages):
            return None
        pages = self._take_pages(n // self.page_size)
        slots = pages[:, None] * self.page_size + torch.arange(self.page_size)
        return slots.reshape(-1).to(self.device)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int | None = None) -> torch.Tensor | None:
        """Slots for tokens ``[prefix_lens[i], seq_lens[i])`` of each request, concatenated.

        ``last_loc[i]`` is the slot of the request's last prefix token (``-1``
        when the prefix is empty). For each request, in order:

        1. fill the rest of the prefix's partial last page (slots after ``last_loc``);
        2. take whole new pages for the full pages that follow;
        3. take one more page for a partial final page, if the sequence ends inside one.

        Returns None, changing nothing, when the free pages do not cover all requests.
        """
        ps = self.page_size
        prefix, seq, last = self._check_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)

        # Pages each request needs beyond those its prefix already touches.
        num_new_pages = (seq + ps - 1) // ps - (prefix + ps - 1) // ps
        if int(num_new_pages.sum()) > len(self.free_pages):
            return None
        new_pages = self._take_pages(int(num_new_pages.sum()))

        offsets = torch.arange(ps)
        out, next_page = [], 0
        for i in range(prefix.numel()):
            p, s, loc = int(prefix[i]), int(seq[i]), int(last[i])
            prefix_page_end = cdiv(p, ps) * ps  # first position past the prefix's last page
            # Case 1: the rest of the prefix's partial last page.
            n1 = min(s, prefix_page_end) - p
            if n1 > 0:
                out.append(loc + 1 + offsets[:n1])
            # Case 2: whole new pages.
            n_full = max(s // ps - prefix_page_end // ps, 0)
            if n_full:
                pages = new_pages[next_page : next_page + n_full]
                out.append((pages[:, None] * ps + offsets).reshape(-1))
                next_page += n_full
            # Case 3: a partial final page, when the sequence ends inside a page of its own.
            n3 = s % ps if s > prefix_page_end else 0
            if n3:
                out.append(new_pages[next_page] * ps + offsets[:n3])
                next_page += 1
        # The page count above and the cases must agree (a failure is our bug).
        require(next_page == new_pages.numel(), "every page taken is placed",
                lambda: f"{next_page} of {new_pages.numel()} placed")
        result = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
        return result.to(self.device)

    def _check_extend(self, prefix_lens, seq_lens, last_loc,
                      extend_num_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``alloc_extend``'s arguments as int64 tensors, refused (nothing changed) unless consistent."""
        ps = self.page_size
        prefix = _index_tensor(prefix_lens, "prefix_lens")
        seq = _index_tensor(seq_lens, "seq_lens")
        last = _index_tensor(last_loc, "last_loc")
        if not (prefix.shape == seq.shape == last.shape):
            raise ValueError(
                f"prefix_lens, seq_lens and last_loc must have one entry per request, got "
                f"{prefix.numel()}, {seq.numel()}, {last.numel()}"
            )
        bad = (prefix < 0) | (seq < prefix)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"request {i}: need 0 <= prefix_len <= seq_len, got {int(prefix[i])} and {int(seq[i])}")
        bad = (last + 1) % ps != prefix % ps
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"request {i}: last_loc {int(last[i])} does not sit at offset (prefix_len - 1) % page_size "
                f"= {(int(prefix[i]) - 1) % ps} of its page (prefix_len {int(prefix[i])}, page_size {ps})"
            )
        partial = (prefix % ps != 0) & (seq > prefix)  # requests that write into their prefix's last page
        tail_pages = last[partial] // ps
        held = (tail_pages >= 1) & (tail_pages <= self.num_pages)
        held &= self._allocated[tail_pages.clamp(0, self.num_pages)]
        if not bool(held.all()):
            i = int(partial.nonzero()[~held][0, 0])
            raise ValueError(
                f"request {i}: last_loc {int(last[i])} points into page {int(tail_pages[~held][0])}, "
                "which is not an allocated page"
            )
        if torch.unique(tail_pages).numel() != tail_pages.numel():
            raise ValueError("two requests extend the same partial page; its free slots would be handed out twice")
        extend = seq - prefix
        if extend_num_tokens is not None and check_int(extend_num_tokens, "extend_num_tokens", 0) != int(extend.sum()):
            raise ValueError(f"extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens) = {int(extend.sum())}")
        return prefix, seq, last

    def alloc_decode(self, seq_lens, last_loc) -> torch.Tensor | None:
        """One slot per request for its next token; ``seq_lens`` already counts that token.

        The slot is ``last_loc + 1`` unless the new token starts a page, in
        which case it is the first slot of a fresh page.
        """
        seq = _index_tensor(seq_lens, "seq_lens")
        bad = seq < 1
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"request {i}: seq_len {int(seq[i])} must count the new token (>= 1)")
        return self.alloc_extend(seq - 1, seq, last_loc)

    def free(self, free_index) -> None:
        """Free the pages holding these slots (a page is freed whole, as in SGLang).

        The pages go to the head of the free list in ascending page order
        (``torch.unique`` sorts them), whatever order the slots came in.
        """
        idx = _index_tensor(free_index, "free_index")
        if idx.numel() == 0:
            return
        self._release(torch.unique(idx // self.page_size))

    def free_segment(self, free_index, *, start_pos: int) -> None:
        """Free one request's run of slots, ``kv_row[start_pos : start_pos + n]``.

        ``start_pos`` sits on a page boundary and the slots fill their pages
        in order (the last page may be partial), so every ``page_size``-th
        slot names the next page: the pages are freed in the request's own
        order, not sorted as ``free`` sorts them. SGLang's radix cache frees
        a request's pages this way.
        """
        start = check_int(start_pos, "start_pos", 0)
        if start % self.page_size:
            raise ValueError(f"segment start {start} is not page-aligned (page_size {self.page_size})")
        idx = _index_tensor(free_index, "free_index")
        if idx.numel() == 0:
            return
        ps = self.page_size
        pages = idx[::ps] // ps
        # Slot k of the segment must be offset k % ps of its page, and no page twice.
        offsets = torch.arange(idx.numel(), device=idx.device) % ps
        laid_out = pages.repeat_interleave(ps)[: idx.numel()] * ps + offsets
        if not torch.equal(idx, laid_out):
            k = int((idx != laid_out).nonzero()[0, 0])
            raise ValueError(
                "free_segment needs one request's slots in order from a page boundary:"
                f" slot {int(idx[k])} at segment position {k} is not offset {k % ps}"
                f" of page {int(pages[k // ps])}")
        uniq, counts = torch.unique(pages, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"page {int(uniq[counts > 1][0])} appears twice in one free_segment()")
        self._release(pages)

    def _release(self, pages: torch.Tensor) -> None:
        """Put these distinct pages at the head of the free list, in the given order."""
        bad = (pages < 1) | (pages > self.num_pages)
        if bool(bad.any()):
            v = int(pages[bad][0])
            raise ValueError(
                f"cannot free page {v}: " + ("page 0 is the padding page" if v == 0 else f"outside 1..{self.num_pages}")
                + f" (slots {v * self.page_size}..{(v + 1) * self.page_size - 1})"
            )
        not_held = ~self._allocated[pages]
        if bool(not_held.any()):
            raise ValueError(f"cannot free page {int(pages[not_held][0])}: it is not allocated (double free?)")
        self._allocated[pages] = False
        # Freed pages go to the head: they are reused first (as in SGLang's paged allocator).
        self.free_pages = torch.cat((pages.to(self.device), self.free_pages))

    def check(self) -> None:
        """No page is free twice; free and allocated pages partition 1..num_pages; page 0 is in neither."""
        _check_free_partition(self.free_pages.cpu(), self._allocated, self.num_pages, "page")
