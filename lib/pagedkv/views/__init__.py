"""Everything the book draws: live views, their static renderings, the trace replay, figures.

One concept per module:

- ``style``: colours, the owner palette, the shared SVG cell;
- ``owners``: ``BlockOwners``, who holds which block;
- ``pool_picture`` / ``block_table_picture``: the static renderings
  (``render_pool``, ``render_block_table``), deterministic HTML;
- ``gather_picture``: Model Runner V2's rows kept for life and the step's
  table gathered from them (``render_gather``);
- ``paged_layout``: PagedAttention's own picture (logical blocks, table
  entries, physical blocks), ``render_paged_layout`` and ``PagedLayoutView``;
- ``pool_view`` / ``table_view``: the live JupyterLab views, and
  ``following``, how they keep up with an engine (throttled);
- ``trace`` / ``replay`` (+ ``replay.js``): ``TraceRecorder`` and its player;
  ``engine_trace``: the same recorder on an engine's steps;
- ``engine_step``: ``StepTrace``, every stage of every step of an engine
  with its values, and the map of one step drawn from it
  (``render_engine_step``, ``render_async_overlap``);
- ``figures``, ``calculator``: matplotlib figures and the budget calculator;
- ``kv_buffer``: chapter 1's picture of the KV buffer and its per-layer views;
- ``fragmentation``: chapter 2's plots and its ipywidgets explorer;
- ``slot_picture``: chapter 5's block-major cache, token by token;
- ``explorables`` (+ ``explore*.js``): figures recomputed in the page by a
  small JavaScript module as the reader moves the controls, no kernel needed.

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
    **dict.fromkeys(["COLORS", "owner_color"], "style"),
    **dict.fromkeys(["BlockOwners"], "owners"),
    **dict.fromkeys(["BlockCell", "describe_blocks", "render_pool"], "pool_picture"),
    "render_block_table": "block_table_picture",
    "render_gather": "gather_picture",
    "BlockPoolView": "pool_view",
    "BlockTableView": "table_view",
    **dict.fromkeys(["PagedLayout", "PagedLayoutView", "describe_layout", "render_paged_layout"], "paged_layout"),
    **dict.fromkeys(["TraceRecorder", "describe_event"], "trace"),
    **dict.fromkeys(["Frame", "Replay", "replay_html"], "replay"),
    "EngineTrace": "engine_trace",
    **dict.fromkeys(["StepTrace", "StepRecord", "render_engine_step", "render_async_overlap"], "engine_step"),
    **dict.fromkeys(["allocation_layout", "attention_grid_figure", "block_table_figure", "kv_usage_figure",
                     "pool_history_figure", "pool_snapshot"],
                    "figures"),
    **dict.fromkeys(["BudgetCalculator", "plot_budget", "plot_shared_card"], "calculator"),
    **dict.fromkeys(["page_offsets", "plot_kv_buffer"], "kv_buffer"),
    **dict.fromkeys(["plot_slots", "slot_owners"], "slot_picture"),
    **dict.fromkeys(["Explorable", "budget_explorer", "prefix_explorer", "slots_explorer", "tail_explorer"], "explorables"),
    **dict.fromkeys(["PART_COLORS", "PART_LABELS", "draw_extents", "plot_tail_residues",
                     "plot_composition", "composition_table", "plot_concurrency",
                     "plot_block_size_sweep", "composition_html", "FragmentationExplorer"], "fragmentation"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'pagedkv.views' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
