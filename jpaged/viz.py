"""Matplotlib pictures of the paged KV cache: the pool, the block tables, metrics over time.

Every function takes plain data (``LLM.cache_state()`` / ``LLM.metrics_history()``, or their
JSON round trip) and returns a ``matplotlib.figure.Figure`` built without pyplot, so it works
under any backend (Agg included) and leaks no global figures. In a notebook, a returned figure
is drawn inline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NULL_COLOR = "#4d4d4d"
FREE_COLOR = "#ececec"
CACHED_FREE_COLOR = "#9fd38a"
SHARED_COLOR = "#1f1f3a"
# Request colours: tab20 without its greys and greens (kept for free / cached blocks).
_PALETTE = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#d62728", "#ff9896", "#9467bd",
            "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#bcbd22", "#dbdb8d",
            "#17becf", "#9edae5")
MAX_LEGEND_REQUESTS = 12
MAX_LABELLED_CELLS = 512  # above this many cells, block ids are not written into the cells

_STATE_KEYS = ("num_blocks", "status", "ref_counts", "owners", "requests")
_HISTORY_KEYS = ("time", "kv_cache_usage", "num_requests_running", "num_requests_waiting",
                 "prefix_cache_hit_rate", "num_preemptions")


def _mpl() -> Any:
    try:
        import matplotlib.colors
        import matplotlib.figure
        import matplotlib.patches
        import matplotlib.ticker
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("jpaged.viz needs matplotlib: pip install matplotlib "
                          "(or jpaged[dev])") from e
    return matplotlib


def _check(data: Mapping[str, Any], keys: Sequence[str], what: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"{what} lacks {missing}; pass the dict returned by LLM.{what}()")


def request_colors(state: Mapping[str, Any]) -> dict[str, str]:
    """One colour per request of the state, in block-table order (the same in every plot)."""
    return {rid: _PALETTE[i % len(_PALETTE)] for i, rid in enumerate(state["requests"])}


def _short(rid: str, n: int = 18) -> str:
    return rid if len(rid) <= n else rid[: n - 1] + "…"


def _grid(ax: Any, rows: int, cols: int) -> None:
    ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)


def block_colors(state: Mapping[str, Any]) -> list[str]:
    """The colour of each physical block in plot_pool: owner, shared, cached free, free, null."""
    colors = request_colors(state)
    out = []
    for status, owners in zip(state["status"], state["owners"], strict=True):
        if status == 0:
            out.append(NULL_COLOR)
        elif len(owners) > 1:
            out.append(SHARED_COLOR)
        elif owners:
            out.append(colors.get(owners[0], SHARED_COLOR))
        else:
            out.append(CACHED_FREE_COLOR if status == 2 else FREE_COLOR)
    return out


def plot_pool(state: Mapping[str, Any], ncols: int | None = None) -> Figure:
    """The pool as a grid of blocks coloured by owning request, shared, cached free, free, null."""
    _check(state, _STATE_KEYS, "cache_state")
    mpl = _mpl()
    n = int(state["num_blocks"])
    cols = ncols or min(64, max(8, math.ceil(math.sqrt(2 * n))))
    rows = math.ceil(n / cols)
    img = [[(0.0, 0.0, 0.0, 0.0)] * cols for _ in range(rows)]  # transparent past the pool
    cell_colors = block_colors(state)
    for i, c in enumerate(cell_colors):
        img[i // cols][i % cols] = mpl.colors.to_rgba(c)
    fig = mpl.figure.Figure(figsize=(min(16.0, 3.5 + 0.3 * cols), min(12.0, 1.6 + 0.3 * rows)),
                            layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(img, interpolation="nearest", aspect="equal")
    _grid(ax, rows, cols)
    ax.set_xticks([])
    ax.set_yticks([])
    if n <= MAX_LABELLED_CELLS:
        dark = {NULL_COLOR, SHARED_COLOR}
        for i, c in enumerate(cell_colors):
            ax.text(i % cols, i // cols, str(i), ha="center", va="center", fontsize=6,
                    color="white" if c in dark else "black")
    used = sum(1 for s in state["status"] if s == 3)
    cached = sum(1 for s in state["status"] if s == 2)
    ax.set_title(f"KV pool: {used} in use, {cached} cached free, {n - 1 - used - cached} free "
                 f"of {n - 1} blocks (block 0 = null)", fontsize=9)
    handles = _legend_handles(mpl, state)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False)
    return fig


def _legend_handles(mpl: Any, state: Mapping[str, Any]) -> list[Any]:
    patch = mpl.patches.Patch
    colors = request_colors(state)
    handles = [patch(color=c, label=_short(rid))
               for rid, c in list(colors.items())[:MAX_LEGEND_REQUESTS]]
    if len(colors) > MAX_LEGEND_REQUESTS:
        handles.append(patch(color="white", label=f"… {len(colors) - MAX_LEGEND_REQUESTS} more"))
    handles += [patch(color=SHARED_COLOR, label="shared (ref > 1)"),
                patch(color=CACHED_FREE_COLOR, label="cached, free"),
                patch(color=FREE_COLOR, label="free"), patch(color=NULL_COLOR, label="null")]
    return handles


def plot_block_tables(state: Mapping[str, Any], max_requests: int = 32) -> Figure:
    """Each request's block table: row = request, column = logical block, cell = physical id.

    With KV cache groups (a model with sliding-window layers) a request has one row per group;
    a sliding group's positions behind its window hold the null block (drawn as null).
    """
    _check(state, _STATE_KEYS, "cache_state")
    mpl = _mpl()
    reqs = list(state["requests"].items())[:max_requests]
    colors = request_colors(state)
    owners = state["owners"]
    groups = state.get("kv_cache_groups") or [{"kind": "full", "sliding_window": None}]
    lines: list[tuple[str, str, list[int]]] = []  # (request id, row label, table)
    for rid, e in reqs:
        tables = e.get("block_tables") or [e["block_table"]]
        for g, table in enumerate(tables):
            label = f"{_short(rid)} ({e.get('num_tokens', '?')} tok)"
            if len(tables) > 1:
                w = groups[g].get("sliding_window") if g < len(groups) else None
                label += f" g{g} " + ("full" if w is None else f"win {w}")
            lines.append((rid, label, table))
    width = max((len(t) for _, _, t in lines), default=0)
    rows = max(1, len(lines))
    cols = max(1, width)
    fig = mpl.figure.Figure(figsize=(min(16.0, 3.0 + 0.35 * cols), min(12.0, 1.4 + 0.35 * rows)),
                            layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Block tables: logical → physical block id\n"
                 "(dark: one physical block shared by several requests)", fontsize=9)
    if not lines:
        ax.text(0.5, 0.5, "no request holds blocks", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    img = [[(0.0, 0.0, 0.0, 0.0)] * cols for _ in range(rows)]
    label = rows * cols <= MAX_LABELLED_CELLS
    for r, (rid, _, table) in enumerate(lines):
        for j, b in enumerate(table):
            if b == 0:  # a sliding group's position behind the window
                img[r][j] = mpl.colors.to_rgba(NULL_COLOR)
                continue
            shared = len(owners[b]) > 1
            img[r][j] = mpl.colors.to_rgba(SHARED_COLOR if shared else colors[rid])
            if label:
                ax.text(j, r, str(b), ha="center", va="center", fontsize=6,
                        color="white" if shared else "black")
    ax.imshow(img, interpolation="nearest", aspect="equal")
    _grid(ax, rows, cols)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([lab for _, lab, _ in lines], fontsize=7)
    ax.set_xticks(range(0, cols, max(1, cols // 16)))
    ax.set_xlabel("logical block index")
    patch = mpl.patches.Patch
    handles = [patch(color=SHARED_COLOR, label="shared"),
               patch(color=_PALETTE[0], label="private (request colour)")]
    if len(groups) > 1 or any(g.get("sliding_window") for g in groups):
        handles.append(patch(color=NULL_COLOR, label="freed: behind the window"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False)
    return fig


def plot_metrics(history: Sequence[Mapping[str, Any]]) -> Figure:
    """KV usage, running/waiting requests, prefix hit rate and preemptions over time (4 panels)."""
    if isinstance(history, Mapping):
        raise ValueError("history must be the list returned by LLM.metrics_history()")
    for p in history[:1]:
        _check(p, _HISTORY_KEYS, "metrics_history")
    mpl = _mpl()
    fig = mpl.figure.Figure(figsize=(9.0, 5.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    t = [p["time"] for p in history]
    panels = [
        (axes[0], "KV cache usage (%)", [("usage", [100 * p["kv_cache_usage"] for p in history])]),
        (axes[1], "requests", [("running", [p["num_requests_running"] for p in history]),
                               ("waiting", [p["num_requests_waiting"] for p in history])]),
        (axes[2], "prefix cache hit rate",
         [("hit rate", [p["prefix_cache_hit_rate"] for p in history])]),
        (axes[3], "preemptions (total)",
         [("preemptions", [p["num_preemptions"] for p in history])]),
    ]
    for ax, title, series in panels:
        for name, ys in series:
            ax.step(t, ys, where="post", label=name)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    axes[0].set_ylim(0, 100)
    axes[2].set_ylim(0, 1)
    for ax in (axes[1], axes[3]):
        ax.yaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
    for ax in axes[2:]:
        ax.set_xlabel("time since engine start (s)")
    if not history:
        fig.suptitle("no engine steps recorded yet", fontsize=9)
    return fig
