"""The live picture of block tables in JupyterLab: ``update(rows)`` redraws, or follow an engine.

An ``ipywidgets.HTML`` showing ``render_block_table``; its rich display also
carries that static HTML, so the built page shows it (and, without
ipywidgets, shows only it).
"""

from __future__ import annotations

from ..block_pool import BlockPool
from .block_table_picture import normalise_rows, render_block_table
from .following import EngineFollower, follow_engine, unfollow

try:  # optional: the static rendering works without it
    import ipywidgets as _ipywidgets
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    _ipywidgets = None

__all__ = ["BlockTableView"]


class BlockTableView:
    """Block tables as a table of physical block ids; ``update(rows)`` redraws."""

    def __init__(self, rows, pool: BlockPool | None = None, title: str | None = None,
                 max_columns: int = 32) -> None:
        self.rows, self.pool, self.title, self.max_columns = rows, pool, title, max_columns
        self.widget = _ipywidgets.HTML(value=self.static_html()) if _ipywidgets is not None else None
        self.min_interval = 0.1  # attach(engine): the most redraws per second ...
        self.max_overhead = 0.05  # ... and the most of the run they may take
        self.redraws = 0
        self.draw_seconds = 0.0  # attach(engine): time spent redrawing after steps
        self._engine: EngineFollower | None = None

    def static_html(self) -> str:
        return render_block_table(self.rows, self.pool, self.title, self.max_columns)

    def update(self, rows=None) -> None:
        """Redraw, with new rows if given (the same mapping, mutated, works too)."""
        if rows is not None:
            self.rows = rows
        self.redraws += 1
        if self.widget is not None:
            self.widget.value = self.static_html()

    def attach(self, engine) -> None:
        """Follow a ``pagedkv.engine.LLMEngine``: show its worker's rows, redrawn after steps (throttled)."""
        if self._engine is None:
            if self.pool is None and hasattr(engine, "kv_cache_manager"):
                self.pool = engine.kv_cache_manager.block_pool
            worker = getattr(engine, "worker", None)
            if worker is None:
                raise TypeError(f"attach(engine) needs a pagedkv.engine.LLMEngine, got {type(engine).__name__}")
            self._engine = follow_engine(self, engine, lambda: self.update(worker.rows()))

    def close(self) -> None:
        """Stop following the engine."""
        unfollow(self._engine)
        self._engine = None

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {}
        if self.widget is not None:
            self.update()
            data.update(self.widget._repr_mimebundle_() or {})
        data["text/plain"] = f"BlockTableView of {len(normalise_rows(self.rows))} rows"
        data["text/html"] = self.static_html()
        return data
