"""Merging the replicas' metrics: the totals get_metrics reports and the per-replica
Prometheus collector."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from jpaged.metrics import PREFIX, describe_metric, flatten_numeric


class MetricsSource(Protocol):
    """What ReplicaCollector reads: each replica's latest metrics and their totals."""

    def replica_metrics(self) -> list[dict[str, Any]]:
        """Each replica's latest metrics ({} while it is down)."""
        ...

    def get_metrics(self) -> dict[str, Any]:
        """Totals over the replicas."""
        ...


def _is_fraction(key: str) -> bool:
    return "usage" in key or "rate" in key or "perc" in key


def metric_totals(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters and counts summed, fractions averaged."""
    flat = [dict(flatten_numeric(m)) for m in per_replica]
    out: dict[str, Any] = {}
    for key in flat[0] if flat else ():
        vals = [m[key] for m in flat if key in m]
        out[key] = sum(vals) / len(vals) if _is_fraction(key) else sum(vals)
    return out


class ReplicaCollector:
    """Every engine metric with an `engine` label per replica, plus engine="total"."""

    def __init__(self, client: MetricsSource) -> None:
        self.client = client

    def collect(self) -> Iterator[Any]:
        """Yield one family per metric, a sample per replica and the total."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        per = self.client.replica_metrics()
        rows: dict[str, list[tuple[str, float]]] = {}
        for r, m in enumerate(per):
            for key, value in flatten_numeric(m):
                rows.setdefault(key, []).append((str(r), value))
        totals = dict(flatten_numeric(self.client.get_metrics()))
        seen: set[str] = set()
        for key in list(rows) + [k for k in totals if k not in rows]:
            name, kind, doc = describe_metric(key)
            if name in seen:
                continue
            seen.add(name)
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"{PREFIX}{name}", doc, labels=["engine"])
            for label, value in rows.get(key, []):
                family.add_metric([label], value)
            if key in totals:
                family.add_metric(["total"], totals[key])
            yield family
