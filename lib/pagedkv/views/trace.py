"""Recording a trace: one frame (a caption and a picture) per change, replayed by ``replay``.

``TraceRecorder`` is the one recorder of the book. On its own it listens to a
block pool and draws one frame per pool mutation; ``EngineTrace``
(``engine_trace.py``) is the same recorder listening to an engine's steps
instead. Both keep at most ``max_frames`` frames (later ones are counted in
``dropped``), span notebook cells with ``start()``/``stop()`` or a ``with``
block, and hand their frames to the same player.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager

from ..block_pool import BlockPool
from ..pool_events import PoolEvent
from .owners import BlockOwners, Owners
from .pool_picture import render_pool
from .replay import Frame, Replay

__all__ = ["TraceRecorder", "describe_event"]


def _ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ids)) + "]"


def describe_event(event: PoolEvent, evicted: Sequence[int] = ()) -> str:
    """A one-line caption for a pool event."""
    k, ids = event.kind, event.block_ids
    if k == "allocate":
        text = f"get_new_blocks({len(ids)}) \u2192 {_ids(ids)} popped from the head"
        if evicted:
            text += f"; cache entries of {_ids(evicted)} die at reuse"
        return text
    if k == "free":
        parts = [f"free_blocks({_ids(ids)})"]
        if event.head:
            parts.append(f"{_ids(event.head)} \u2192 head (no hash)")
        if event.tail:
            parts.append(f"{_ids(event.tail)} \u2192 tail (hashed, still cached)")
        still = [b for b in ids if b not in event.head and b not in event.tail]
        if still:
            parts.append(f"{_ids(sorted(set(still)))} still held")
        return "; ".join(parts)
    if k == "touch":
        return f"touch({_ids(ids)}): prefix hit, ref_cnt + 1"
    if k == "cache":
        return f"cache_full_blocks: {_ids(ids)} hashed into the prefix cache"
    if k == "reset":
        return f"reset_prefix_cache(): {len(ids)} hashes cleared"
    if k == "evict":
        return f"evict {_ids(ids)}"
    if k == "uncache":
        return f"evict_blocks({_ids(ids)}): cache entries dropped, blocks stay free"
    return k


class TraceRecorder:
    """Record a pool's mutations as frames: ``with TraceRecorder(pool) as rec: ...``.

    Each mutation becomes one frame (caption plus the picture right after it,
    with the touched blocks outlined). An ``"evict"`` event is folded into the
    allocation that caused it. ``snapshot(caption)`` adds a frame by hand;
    ``acting_for(name)`` labels the blocks of the calls inside it (see
    ``BlockOwners``). ``replay()`` returns the player.

    A subclass records something else by overriding ``_listen`` (subscribe,
    return the unsubscribe function) and ``_render`` (the picture of now).
    """

    def __init__(self, pool: BlockPool, owners: Owners = None, title: str | None = None,
                 max_frames: int = 200, columns: int | None = None, groups=None, names=None) -> None:
        self.pool, self.title, self.columns = pool, title, columns
        self.groups, self.names = groups, names  # KV-cache groups: see render_pool
        self._own_owners = owners is None
        self.owners: Owners = BlockOwners(pool) if owners is None else owners
        self.max_frames = max_frames
        self.frames: list[Frame] = []
        self.dropped = 0  # frames beyond max_frames
        self._evicted: tuple[int, ...] = ()
        self._unsubscribe: Callable[[], None] | None = None

    @contextmanager
    def acting_for(self, name: str):
        if not isinstance(self.owners, BlockOwners):
            raise TypeError("acting_for needs BlockOwners (pass owners=None to get one)")
        with self.owners.acting_for(name):
            yield self

    def _render(self, highlight: Iterable[int]) -> str:
        """The picture of this moment: the pool, the blocks in ``highlight`` outlined."""
        return render_pool(self.pool, self.owners, self.title, highlight=highlight, columns=self.columns,
                           groups=self.groups, names=self.names)

    def _listen(self) -> Callable[[], None]:
        """Start hearing the changes to record; returns the function that stops it."""
        return self.pool.subscribe(self._on_event)

    def snapshot(self, caption: str, highlight: Iterable[int] = ()) -> None:
        """Add a frame now."""
        if len(self.frames) >= self.max_frames:
            self.dropped += 1
            return
        self.frames.append(Frame(caption, self._render(highlight)))

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        if event.kind == "evict":
            self._evicted = event.block_ids
            return
        caption = describe_event(event, self._evicted)
        self._evicted = ()
        actor = self.owners.actor if isinstance(self.owners, BlockOwners) else None
        self.snapshot(f"{actor}: {caption}" if actor else caption, highlight=event.block_ids)

    def start(self, caption: str = "start") -> "TraceRecorder":
        """Take a first frame and start listening (``with`` does this; ``start``/``stop`` span cells)."""
        if self._unsubscribe is None:
            self.snapshot(caption)
            self._unsubscribe = self._listen()
        return self

    def stop(self) -> "TraceRecorder":
        """Stop listening; the frames stay."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._own_owners and isinstance(self.owners, BlockOwners):
            self.owners.close()
        return self

    def __enter__(self) -> "TraceRecorder":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def __len__(self) -> int:
        return len(self.frames)

    def captions(self) -> list[str]:
        return [f.caption for f in self.frames]

    def replay(self, title: str | None = None) -> Replay:
        return Replay(list(self.frames), title or self.title)
