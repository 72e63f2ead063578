"""The live picture of a block pool in JupyterLab, redrawn as code mutates the pool.

The view is an ``ipywidgets.HTML`` re-rendered (``render_pool``) at most every
``min_interval`` seconds, and once more after the running cell finishes. It
subscribes to the pool only once displayed, so an undisplayed view costs
nothing. Its rich display carries the static ``text/html`` rendering next to
the widget, so a page built from the executed notebook shows the picture;
without ipywidgets the view displays only that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..block_pool import BlockPool
from ..pool_events import PoolEvent
from .following import EngineFollower, FollowingView, follow_engine, on_cell_end
from .owners import Owners
from .pool_picture import render_pool

try:  # optional: the static rendering works without it
    import ipywidgets as _ipywidgets
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    _ipywidgets = None

__all__ = ["BlockPoolView"]


class BlockPoolView(FollowingView):
    """A live picture of a pool: redrawn as code mutates it, throttled.

    Displaying the view subscribes it to the pool. Each mutation then marks
    the picture stale and redraws it if ``min_interval`` seconds have passed
    since the last redraw; when the running cell ends, a stale picture is
    redrawn once more. Until it is displayed the view costs the pool nothing.
    """

    def __init__(self, pool: BlockPool, owners: Owners = None, title: str | None = None,
                 min_interval: float = 0.1, columns: int | None = None, groups=None,
                 names=None) -> None:
        # groups: a KV-cache coordinator (or {block_id: group}, or a function
        # returning one): in-use blocks take their group's colour, read anew at
        # every redraw, so a sliding window's freed blocks turn free as they go.
        self.pool, self.owners, self.title, self.columns = pool, owners, title, columns
        self.groups, self.names = groups, names
        self.min_interval = float(min_interval)
        self.widget = _ipywidgets.HTML() if _ipywidgets is not None else None
        self._stale = True
        self._last_draw = float("-inf")
        self._unsubscribe: Callable[[], None] | None = None
        self.redraws = 0  # how many times the widget was redrawn (for tests and curiosity)
        self.max_overhead = 0.05  # attach(engine): drawing takes at most this fraction of the run
        self.draw_seconds = 0.0  # attach(engine): time spent redrawing after steps
        self._engine: EngineFollower | None = None

    def static_html(self) -> str:
        return render_pool(self.pool, self.owners, self.title, columns=self.columns,
                           groups=self.groups, names=self.names)

    def refresh(self) -> None:
        """Redraw now."""
        self._stale = False
        self._last_draw = time.monotonic()
        self.redraws += 1
        if self.widget is not None:
            self.widget.value = self.static_html()

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        self._stale = True
        if time.monotonic() - self._last_draw >= self.min_interval:
            self.refresh()

    def _after_cell(self, *args) -> None:
        if self._stale:
            self.refresh()

    def attach(self, engine=None) -> None:
        """Start following the pool (displaying the view does this).

        Given a ``pagedkv.engine.LLMEngine`` (whose pool this view shows),
        follow the engine instead: redraw after its steps rather than after
        each pool mutation, label blocks with the running requests (unless
        ``owners`` was given), and throttle so drawing takes at most
        ``max_overhead`` of the run.
        """
        if engine is not None:
            manager = getattr(engine, "kv_cache_manager", None)
            if manager is None or manager.block_pool is not self.pool:
                raise ValueError("attach(engine): the view must show the engine's pool "
                                 "(BlockPoolView(engine.kv_cache_manager.block_pool))")
            if self.owners is None:
                self.owners = lambda: dict(manager.req_to_blocks)
            if self._engine is None:
                self._engine = follow_engine(self, engine, self.refresh)
            return
        if self._engine is not None:  # already following an engine: displaying only redraws
            if self._stale:
                self.refresh()
            return
        if self._unsubscribe is None:
            self._unsubscribe = self.pool.subscribe(self._on_event)
            on_cell_end(self._after_cell)
        if self._stale:
            self.refresh()

    def describe(self) -> str:
        return f"BlockPoolView of a {self.pool.num_gpu_blocks}-block pool"
