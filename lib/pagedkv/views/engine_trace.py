"""A step-by-step trace of the engine that replays in a static page.

One frame per step: the step's decisions as the caption (``SchedulerOutput.summary``),
then the block pool (owners are the running requests) and the worker's block
table. It is ``TraceRecorder`` listening to the engine's steps (an engine step
listener) instead of the pool's events, so ``replay()`` is the same player the
pool chapters use. The engine knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .block_table_picture import render_block_table
from .pool_picture import render_pool
from .trace import TraceRecorder

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import LLMEngine

__all__ = ["EngineTrace"]


class EngineTrace(TraceRecorder):
    """Records ``max_frames`` steps of an engine (later steps are counted in ``dropped``).

    ``with EngineTrace(engine, title="request A") as trace: engine.step()``;
    or ``start()``/``stop()`` across cells; then ``trace.replay()``.
    """

    def __init__(self, engine: "LLMEngine", max_frames: int = 200, title: str | None = None,
                 max_table_columns: int = 16) -> None:
        manager = engine.kv_cache_manager
        super().__init__(manager.block_pool, owners=lambda: dict(manager.req_to_blocks), title=title,
                         max_frames=max_frames)
        self.engine = engine
        self.max_table_columns = max_table_columns

    def _render(self, highlight: Iterable[int] = ()) -> str:
        """The pool (owners: the requests holding blocks) and, under it, the worker's block table."""
        pool = render_pool(self.pool, self.owners, self.title, highlight=highlight)
        rows = self.engine.worker.rows()
        table = (render_block_table(rows, self.pool, "block table (worker rows)", self.max_table_columns)
                 if rows else "")
        return pool + table

    def _listen(self) -> Callable[[], None]:
        return self.engine.add_step_listener(self._on_step)

    def _on_step(self, engine, out, outputs) -> None:
        caption = out.summary().split(": ", 1)[1]  # the replay numbers the steps itself
        done = [o.request_id + f" ({o.finish_reason})" for o in outputs if o.finished]
        if done:
            caption += f"; finished {', '.join(done)}"
        self.snapshot(caption)
