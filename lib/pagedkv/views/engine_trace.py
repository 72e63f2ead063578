"""A step-by-step trace of the engine that replays in a static page.

One frame per step: the step's decisions as the caption (``SchedulerOutput.summary``),
then the block pool (owners are the running requests) and the worker's block
table. Frames are ``pagedkv.views.Frame``s, so ``replay()`` is the same
player the pool chapters use (inline SVG and a few lines of JavaScript, no network).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .widgets import Frame, Replay
    from ..engine import LLMEngine

__all__ = ["EngineTrace"]


class EngineTrace:
    """Records ``max_frames`` steps of an engine (later steps are counted in ``dropped``)."""

    def __init__(self, engine: "LLMEngine", max_frames: int = 200, title: str | None = None,
                 max_table_columns: int = 16) -> None:
        self.engine = engine
        self.max_frames = max_frames
        self.title = title
        self.max_table_columns = max_table_columns
        self.frames: list[Frame] = []
        self.dropped = 0
        self._unsubscribe = None

    def _render(self) -> str:
        from .widgets import render_block_table, render_pool

        e = self.engine
        owners = {rid: blocks for rid, blocks in e.kv_cache_manager.req_to_blocks.items()}
        pool = render_pool(e.kv_cache_manager.block_pool, owners, self.title)
        rows = e.worker.rows()
        table = (render_block_table(rows, e.kv_cache_manager.block_pool, "block table (worker rows)",
                                    self.max_table_columns) if rows else "")
        return pool + table

    def snapshot(self, caption: str) -> None:
        """Add a frame of the engine as it is now."""
        from .widgets import Frame

        if len(self.frames) >= self.max_frames:
            self.dropped += 1
            return
        self.frames.append(Frame(caption, self._render()))

    def _on_step(self, engine, out, outputs) -> None:
        caption = out.summary().split(": ", 1)[1]  # the replay numbers the steps itself
        done = [o.request_id + f" ({o.finish_reason})" for o in outputs if o.finished]
        if done:
            caption += f"; finished {', '.join(done)}"
        self.snapshot(caption)

    def start(self) -> "EngineTrace":
        if self._unsubscribe is None:
            self.snapshot("start")
            self._unsubscribe = self.engine.add_step_listener(self._on_step)
        return self

    def stop(self) -> "EngineTrace":
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        return self

    def __enter__(self) -> "EngineTrace":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def captions(self) -> list[str]:
        return [f.caption for f in self.frames]

    def replay(self, title: str | None = None) -> "Replay":
        from .widgets import Replay

        return Replay(list(self.frames), title or self.title)

    def __len__(self) -> int:
        return len(self.frames)
