"""Write a benchmark's JSON, print its table, and save a PNG plot beside the JSON."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    import jax

    return {"platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": __import__("os").cpu_count(),
            "date": time.strftime("%Y-%m-%d")}


def median(xs: Sequence[float]) -> float:
    """Median of repeated measurements."""
    return float(statistics.median(xs))


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """A two-column table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    Console().print(table)


def write(out: Path, data: dict[str, Any], plot: Callable[[Any], None] | None = None) -> None:
    """JSON at `out`, and `plot(ax)` rendered to the same name with .png."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = dict(data, machine=machine())
    out.write_text(json.dumps(data, indent=2))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        plot(ax)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110, bbox_inches="tight")  # no clipped labels
        plt.close(fig)
