"""Batch progress: LLM.generate(use_tqdm=...) with a tqdm-like factory, and the CLI's rich bar."""

from __future__ import annotations

import json

from helpers import make_llm, tiny, tiny_model_dir
from typer.testing import CliRunner

from jpaged import SamplingParams
from jpaged.cli import app

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_gpu_blocks_override=128, block_size=8)


class _CountingBar:
    """A tqdm-shaped bar that records what it is told."""

    made: list[_CountingBar] = []

    def __init__(self, total: int, desc: str = "", **_: object) -> None:
        self.total, self.desc, self.n, self.closed = total, desc, 0, False
        _CountingBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_generate_drives_a_tqdm_like_callable():
    llm = make_llm(tiny(), **ENGINE)
    _CountingBar.made.clear()
    prompts = [{"prompt_token_ids": [i + 1] * (3 + i)} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3),
                        use_tqdm=_CountingBar)
    (bar,) = _CountingBar.made
    assert len(outs) == 3 and (bar.total, bar.n, bar.closed) == (3, 3, True)
    assert bar.desc == "Processed prompts"


def test_cli_batch_file_shows_progress_on_stderr(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one", "two", "three")))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    res = CliRunner().invoke(app, ["generate", "--input", str(src), "--output", str(dst),
                                   "--model", str(tiny_model_dir()), "--max-tokens", "3",
                                   "--raw", *flags])
    assert res.exit_code == 0, res.output
    assert res.stdout == ""  # results go to the file, progress to stderr
    assert "Processed prompts" in res.stderr and "3/3" in res.stderr
    assert len(dst.read_text().splitlines()) == 3
