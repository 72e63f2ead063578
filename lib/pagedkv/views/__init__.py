"""Everything the book draws: live views, their static renderings, the trace replay, figures.

The views sit on top of the core and only watch it: a ``BlockPoolView``
subscribes to a ``BlockPool``'s events, an ``EngineTrace`` is an engine step
listener. Nothing in the core imports this package.

Names load lazily (``from pagedkv.views import BlockPoolView``), so importing
one view does not pull in matplotlib or ipywidgets.
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(
        ["COLORS", "owner_color", "BlockCell", "describe_blocks", "render_pool", "render_block_table",
         "BlockOwners", "BlockPoolView", "BlockTableView", "Frame", "TraceRecorder", "Replay",
         "replay_html", "describe_event"], "widgets"),
    **dict.fromkeys(["allocation_layout", "block_table_figure", "pool_history_figure", "pool_snapshot"],
                    "figures"),
    **dict.fromkeys(["BudgetCalculator", "plot_budget"], "calculator"),
    "EngineTrace": "engine_trace",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'pagedkv.views' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
