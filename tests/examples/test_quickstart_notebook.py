"""examples/quickstart.ipynb runs top to bottom on the embedded model in a kernel of this venv."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
KERNEL = "jpaged-test-python"
METRICS_MARK = "JPAGED_METRICS="


def _kernelspec(root: Path, jax_cache: str) -> Path:
    """A kernelspec whose python is this interpreter (not whatever `python` is on PATH)."""
    d = root / "kernels" / KERNEL
    d.mkdir(parents=True)
    (d / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jpaged tests", "language": "python",
        "env": {"JAX_COMPILATION_CACHE_DIR": jax_cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
                # XLA's own optimization level, not the suite's -O0 (tests/conftest.py): the
                # notebook's time is the embedded model's steps running, not compiling.
                "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}}))
    return root


def test_committed_notebook_has_no_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_runs_and_hits_the_prefix_cache(tmp_path, monkeypatch):
    import jax
    import nbformat
    from nbclient import NotebookClient

    cache = jax.config.jax_compilation_cache_dir or str(tmp_path / "jax_cache")
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path / "jupyter", cache)))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    n_cells = len(nb.cells)
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json, sys\nprint({METRICS_MARK!r} + json.dumps(llm.get_metrics()))\n"
        "print('EXECUTABLE=' + sys.executable)"))
    # Raises CellExecutionError (with the cell and traceback) if any cell fails.
    NotebookClient(nb, kernel_name=KERNEL, timeout=600,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    metrics = json.loads(text.split(METRICS_MARK)[1].splitlines()[0])
    assert metrics["prefix_cache_hit_rate"] > 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["kv_cache_usage"] == 0.0  # every request finished, every block returned
    assert f"EXECUTABLE={sys.executable}" in text
    outputs = [o for c in nb.cells[:n_cells] if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 3  # pool, block tables, metrics
