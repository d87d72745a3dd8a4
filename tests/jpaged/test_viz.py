"""jpaged.viz on a real mid-run cache state: figures, axes and artists as expected (no images)."""

from __future__ import annotations

import io
import json

import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams, viz

# The engine shape of tests/jpaged/test_engine.py, so the compiled steps are shared.
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_gpu_blocks_override=128, block_size=8)


@pytest.fixture(scope="module")
def run():
    """A cache state taken while 3 requests sharing a 4-block prefix decode, and the history."""
    llm = make_llm(tiny(), **ENGINE)
    eng = llm.llm_engine
    prefix = list(range(1, 33))
    for i in range(3):
        eng.add_request(f"v{i}", {"prompt_token_ids": prefix + [200 + i] * (3 + 9 * i)},
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    state = llm.cache_state()
    while len(state["requests"]) < 3 or any(e["num_output_tokens"] < 2
                                            for e in state["requests"].values()):
        eng.step()
        state = llm.cache_state()
    while eng.has_unfinished_requests():
        eng.step()
    return json.loads(json.dumps(state)), llm.metrics_history()


def _rgba(c):
    from matplotlib.colors import to_rgba

    return to_rgba(c)


def test_plot_pool(run):
    from matplotlib.figure import Figure

    state, _ = run
    fig = viz.plot_pool(state, ncols=16)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    (img,) = ax.get_images()
    arr = img.get_array()
    assert arr.shape[:2] == (8, 16)  # 128 blocks in rows of 16
    shared = [i for i, o in enumerate(state["owners"]) if len(o) == 3]
    assert len(shared) == 4  # the prefix blocks, held by all three tables
    for i in shared:
        assert tuple(arr[i // 16, i % 16]) == pytest.approx(_rgba(viz.SHARED_COLOR))
    assert tuple(arr[0, 0]) == pytest.approx(_rgba(viz.NULL_COLOR))
    private = state["requests"]["v2"]["block_table"][-1]
    assert tuple(arr[private // 16, private % 16]) == pytest.approx(
        _rgba(viz.request_colors(state)["v2"]))
    assert len(ax.texts) == 128  # block ids written in the cells
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["v0", "v1", "v2", "shared (ref > 1)", "cached, free", "free", "null"]
    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # no pyplot, no display: any backend works
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_plot_block_tables(run):
    state, _ = run
    fig = viz.plot_block_tables(state)
    ax = fig.axes[0]
    (img,) = ax.get_images()
    width = max(len(e["block_table"]) for e in state["requests"].values())
    assert img.get_array().shape[:2] == (3, width)
    cells = sum(len(e["block_table"]) for e in state["requests"].values())
    assert len(ax.texts) == cells
    dark = [t.get_text() for t in ax.texts if t.get_color() == "white"]
    assert len(dark) == 3 * 4  # each table shows the 4 shared prefix blocks as shared
    assert [t.get_text().split(" ")[0] for t in ax.get_yticklabels()] == ["v0", "v1", "v2"]
    empty = viz.plot_block_tables(dict(state, requests={}))
    assert len(empty.axes) == 1 and not empty.axes[0].get_images()


def test_plot_metrics(run):
    _, history = run
    fig = viz.plot_metrics(history)
    assert len(fig.axes) == 4
    assert [len(ax.get_lines()) for ax in fig.axes] == [1, 2, 1, 1]
    usage = fig.axes[0].get_lines()[0].get_ydata()
    assert len(usage) == len(history) and max(usage) > 0
    assert len(viz.plot_metrics([]).axes) == 4


@pytest.mark.parametrize("fn,arg,needle", [
    (viz.plot_pool, {}, "cache_state"),
    (viz.plot_block_tables, {"num_blocks": 2}, "status"),
    (viz.plot_metrics, {"time": 1}, "metrics_history"),
    (viz.plot_metrics, [{"time": 0.0}], "kv_cache_usage"),
])
def test_bad_input_names_what_is_missing(fn, arg, needle):
    with pytest.raises(ValueError, match=needle):
        fn(arg)
