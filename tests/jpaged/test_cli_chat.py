"""`jpaged chat` (scripted stdin through typer's CliRunner) and the ChatSession behind it."""

from __future__ import annotations

from helpers import make_llm, tiny, tiny_model_dir
from typer.testing import CliRunner

from jpaged.chat_cli import ChatSession
from jpaged.cli import app
from jpaged.sampling_params import SamplingParams

# The server tests' engine settings: the compiled step shapes are shared through the cache.
FLAGS = ["--max-model-len", "128", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
         "--block-size", "16", "--num-gpu-blocks-override", "160"]


def test_chat_cli_reset_and_exit():
    args = ["chat", "--model", str(tiny_model_dir()), "--temperature", "0", "--max-tokens", "6",
            *FLAGS]
    result = CliRunner().invoke(app, args, input="hi\nhi\n/reset\nhi\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.output
    turns = result.stdout.split(">>> ")
    # Text after each prompt: '', reply, reply, nothing (/reset), reply, nothing (/exit).
    assert len(turns) == 6 and turns[0] == turns[3] == turns[5] == ""
    first, second, after_reset = (turns[i].removesuffix("\n") for i in (1, 2, 4))
    assert first and first == after_reset  # /reset: the same one-message conversation again
    assert second != first  # without /reset the history is part of the prompt
    assert "conversation cleared" in result.stderr
    eof = CliRunner().invoke(app, args, input="hi\n")  # end of input quits too
    assert eof.exit_code == 0 and eof.stdout.split(">>> ")[1] == turns[1]


def test_chat_session_streams_and_keeps_history():
    engine = make_llm(tiny(), max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
                      block_size=16, num_gpu_blocks_override=160).llm_engine
    chunks: list[str] = []
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          system="You are terse.", write=chunks.append)
    reply = session.ask("hello")
    assert len(chunks) > 2 and "".join(chunks) == reply + "\n"  # streamed, not printed at once
    assert [m["role"] for m in session.history] == ["system", "user", "assistant"]
    assert session.history[-1]["content"] == reply
    session.reset()
    assert session.history == [{"role": "system", "content": "You are terse."}]
    assert not engine.has_unfinished_requests()
    assert engine.get_metrics()["kv_cache_usage"] == 0.0
