"""Callers use the KV cache manager's public API, which has one shape for every model (tables
and hits per KV cache group): no module outside the manager's own reads a private field of
it, nor probes one of its fields with getattr/hasattr (an AST scan of the repository)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The manager's modules: they share its fields among themselves.
MANAGER_MODULES = {
    "jpaged/core/kv_cache_manager.py", "jpaged/core/kv_block_tables.py",
    "jpaged/core/kv_cache_lookup.py", "jpaged/core/kv_cache_policies.py",
    "jpaged/core/kv_cache_groups.py", "jpaged/core/prefix_cache_stats.py",
}
SCANNED = ("jpaged", "models", "pallas_kernels", "scripts", "tests", "examples")
# Fields of the two managers this one replaced: reading them would be a probe of a shape.
FORMER_FIELDS = {"_tables", "_gtables", "_block_ids", "_gids", "_num_cached", "_freed_upto"}


def _python_files() -> list[Path]:
    out: list[Path] = []
    for top in SCANNED:
        out += sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []
    return out


def _manager_members() -> tuple[set[str], set[str]]:
    """(private, public) names the manager modules' classes define: `self.x = ...` targets,
    methods and class attributes."""
    private: set[str] = set()
    public: set[str] = set()
    for rel in MANAGER_MODULES:
        tree = ast.parse((ROOT / rel).read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names: set[str] = set()
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            for name in names:
                if name.startswith("__"):
                    continue
                (private if name.startswith("_") else public).add(name)
    return private, public


def _looks_like_manager(node: ast.expr) -> bool:
    text = ast.unparse(node).lower()
    return "kv" in text or "manager" in text


def test_no_module_reads_a_kv_manager_private_field_or_probes_one():
    private, public = _manager_members()
    assert {"_req_tables", "_in_flight_count"} <= private and "live_block_ids" in public
    forbidden = private | FORMER_FIELDS
    found: list[str] = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in MANAGER_MODULES:
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in forbidden and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                name = node.args[1].value
                if name in forbidden or (name in public and _looks_like_manager(node.args[0])):
                    found.append(f"{rel}:{node.lineno}: probes {ast.unparse(node)}")
    assert not found, "\n".join(found)
