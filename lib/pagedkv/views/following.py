"""How a live view keeps up: redraw after engine steps, throttled, and once more when a cell ends.

``follow_engine(view, engine, redraw)`` subscribes ``redraw`` to an engine's
step listeners (``LLMEngine.add_step_listener``) and to IPython's
``post_run_cell`` event; ``unfollow`` undoes both. A redraw that took ``c``
seconds waits ``c / max_overhead`` before the next one, so however slow the
picture, drawing stays a bounded fraction (5 % by default) of the engine's run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["EngineFollower", "FollowingView", "follow_engine", "unfollow", "on_cell_end", "stop_on_cell_end"]


class EngineFollower:
    """Redraw after engine steps, at most every ``min_interval`` s and at most ``max_overhead`` of the time."""

    def __init__(self, view, redraw: Callable[[], None], min_interval: float, max_overhead: float) -> None:
        self.view, self.redraw, self.min_interval, self.max_overhead = view, redraw, min_interval, max_overhead
        self.last_draw = float("-inf")
        self.last_cost = 0.0
        self.stale = False
        self.unsubscribe: Callable[[], None] | None = None

    def on_step(self, *_args) -> None:
        self.stale = True
        now = time.perf_counter()
        if now - self.last_draw >= max(self.min_interval, self.last_cost / self.max_overhead):
            self.draw()

    def draw(self) -> None:
        t0 = time.perf_counter()
        self.redraw()
        t1 = time.perf_counter()
        self.last_draw, self.last_cost, self.stale = t1, t1 - t0, False
        self.view.draw_seconds += t1 - t0  # what following the engine has cost so far

    def after_cell(self, *_args) -> None:
        if self.stale:
            self.draw()


def follow_engine(view, engine, redraw: Callable[[], None]) -> EngineFollower:
    """Subscribe ``redraw`` to ``engine``'s steps (and to the end of each notebook cell)."""
    if not hasattr(engine, "add_step_listener"):
        raise TypeError(f"attach(engine) needs a pagedkv.engine.LLMEngine, got {type(engine).__name__}")
    follower = EngineFollower(view, redraw, view.min_interval, view.max_overhead)
    follower.unsubscribe = engine.add_step_listener(follower.on_step)
    on_cell_end(follower.after_cell)
    follower.draw()
    return follower


def unfollow(follower: EngineFollower | None) -> None:
    """Undo ``follow_engine`` (nothing for None)."""
    if follower is None:
        return
    follower.unsubscribe()
    stop_on_cell_end(follower.after_cell)


def on_cell_end(callback) -> None:
    """Call ``callback`` after every notebook cell, if IPython is running."""
    ip = _ipython()
    if ip is not None:
        ip.events.register("post_run_cell", callback)


def stop_on_cell_end(callback) -> None:
    """Unregister a post-run-cell hook, if IPython is here and the hook still is."""
    ip = _ipython()
    if ip is not None:
        try:
            ip.events.unregister("post_run_cell", callback)
        except ValueError:
            pass


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return None
    return get_ipython()


class FollowingView:
    """What a live view that follows a pool's events or an engine's steps shares.

    The view keeps ``_engine`` (its ``EngineFollower`` or None), ``_unsubscribe``
    (the pool subscription's undo, or None), ``_after_cell`` (its end-of-cell
    redraw), ``widget`` and ``static_html()``; it defines ``attach()`` and
    ``describe()`` (its ``text/plain``).
    """

    def close(self) -> None:
        """Stop following the pool (or the engine)."""
        unfollow(self._engine)
        self._engine = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            stop_on_cell_end(self._after_cell)

    def _repr_mimebundle_(self, include=None, exclude=None):
        self.attach()
        data = {}
        if self.widget is not None:
            data.update(self.widget._repr_mimebundle_() or {})
        data["text/plain"] = self.describe()
        data["text/html"] = self.static_html()
        return data
