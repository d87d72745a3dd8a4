"""Benchmark support shared by scripts/: workloads, timing, reports (JSON, table, PNG)."""
