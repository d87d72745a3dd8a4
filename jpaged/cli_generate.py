"""`jpaged generate` (prompts from the command line or a JSONL file) and `jpaged chat`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from jpaged.cli_common import create_engine, fail, run_worker_if_not_rank0, setup_logging
from jpaged.cli_engine_flags import engine_args, with_engine_flags


def read_prompts(path: Path) -> list[str]:
    """The prompts of a --input JSONL file: one {"prompt": "..."} object a line (blank lines
    skipped); anything else stops the command with the file and line named."""
    if not path.is_file():
        fail(f"--input file not found: {path}" if not path.exists()
             else f"--input is not a file: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        fail(f"--input {path} is not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        fail(f"--input: cannot read {path}: {e.strerror or e}")
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{where}: not JSON ({e})")
        if not isinstance(obj, dict) or "prompt" not in obj:
            fail(f"{where}: expected a JSON object with 'prompt', got {line.strip()[:60]}")
        if not isinstance(obj["prompt"], str):
            fail(f"{where}: 'prompt' must be a string")
        if extra := sorted(set(obj) - {"prompt"}):
            fail(f"{where}: unknown key(s) {', '.join(map(repr, extra))}: a line holds only "
                 "'prompt'; the command's flags set max tokens and sampling")
        out.append(obj["prompt"])
    return out


# Offline use logs no periodic stats (vLLM's LLM): no --disable-log-stats here.
@with_engine_flags(exclude=("disable_log_stats",))
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = -1,
    min_p: Annotated[float, typer.Option("--min-p")] = 0.0,
    n: Annotated[int, typer.Option("--n", help="Completions per prompt.")] = 1,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt.")] = False,
    input_file: Annotated[Path | None, typer.Option("--input",
                                                    help="JSONL file of {'prompt': ...}.")] = None,
    output_file: Annotated[Path | None, typer.Option("--output",
                                                     help="Write JSONL results here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    lora_path: Annotated[Path | None, typer.Option(
        "--lora-path", help="Run every prompt with this LoRA adapter (a PEFT directory; "
        "turns on --enable-lora, its rank at most --max-lora-rank).")] = None,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Complete prompts with the paged engine (chat template applied unless --raw)."""
    flags = engine_flags or {}
    setup_logging(verbose)
    if run_worker_if_not_rank0(flags):
        return
    texts = list(prompts or [])
    if input_file is not None:
        texts.extend(read_prompts(input_file))
    if output_file is not None:  # checked before the model loads, not after the batch ran
        if output_file.is_dir():
            fail(f"--output is a directory: {output_file}")
        if not output_file.parent.is_dir():
            fail(f"--output: no such directory: {output_file.parent}")
    if not texts:
        fail("give at least one PROMPT or --input FILE")
    if lora_path is not None:
        if not lora_path.is_dir():
            fail(f"--lora-path: not a directory: {lora_path}")
        flags = {**flags, "enable_lora": True}
    for i, t in enumerate(texts, 1):  # checked before the model loads
        if not t:
            fail(f"prompt {i} is empty")
    from jpaged.llm import LLM
    from jpaged.lora_request import LoRARequest
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now
    from jpaged.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, max_tokens=max_tokens, seed=flags.get("seed", 0))
        llm = LLM(**flags)
        tok = llm.get_tokenizer()
        inputs: list[Any] = []
        for t in texts:
            if raw or not tok.has_chat_template:
                inputs.append(t)
            else:
                templ = tok.apply_chat_template([{"role": "user", "content": t}])
                inputs.append({"prompt": t,
                               "prompt_token_ids": tok.encode(templ, add_special_tokens=False)})
        # A batch written to a file always reports progress on stderr (one final line when
        # stderr is not a terminal); several prompts to a terminal only when it is one.
        show = output_file is not None or (len(inputs) > 1 and sys.stderr.isatty())
        lora = (None if lora_path is None else
                LoRARequest(lora_path.resolve().name or "adapter", 1, str(lora_path)))
        outs = llm.generate(inputs, params, use_tqdm=show, lora_request=lora)
        llm.llm_engine.shutdown()  # a multi-process run: the other processes stop too
    except ProcessGroupError as e:
        exit_now(e)
        return
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    try:
        sink = output_file.open("w") if output_file is not None else None
    except OSError as e:
        fail(f"--output: cannot write {output_file}: {e.strerror or e}")
    try:
        for out in outs:
            for c in out.outputs:
                rec = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                       "finish_reason": c.finish_reason}
                if sink is not None:
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                elif as_json:
                    typer.echo(json.dumps(rec, ensure_ascii=False))
                else:
                    typer.echo(c.text)
    finally:
        if sink is not None:
            sink.close()


@with_engine_flags(exclude=("disable_log_stats",))
def chat(
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Longest reply in tokens (default: up to --max-model-len).")
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Chat interactively: replies stream as they are made; /reset, /exit."""
    flags = engine_flags or {}
    setup_logging(verbose)
    if run_worker_if_not_rank0(flags):
        return
    from jpaged.chat_cli import ChatSession, run_chat
    from jpaged.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                seed=flags["seed"])
        engine = create_engine(engine_args(flags, disable_log_stats=True))
        session = ChatSession(engine, params, system=system)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    run_chat(session)
    engine.shutdown()  # a multi-process run: the other processes stop too
