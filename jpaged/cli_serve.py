"""`jpaged serve`: the OpenAI-compatible server over one engine, or over data-parallel
replicas on Ray (disaggregated prefill/decode included)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any

import typer

from jpaged.cli_common import create_engine, fail, run_worker_if_not_rank0
from jpaged.cli_engine_flags import engine_args, with_engine_flags
from jpaged.config import DEFAULT_HOST, DEFAULT_MAX_STORED_RESPONSES, DEFAULT_PORT

# Front-end options serve and run-batch share (vLLM's names).
ServedModelNameOption = Annotated[list[str] | None, typer.Option(
    "--served-model-name", help="The name(s) requests use for the model (vLLM's list: "
    "`--served-model-name a b`; answers carry the first; default: --model as given).")]
LoraModulesOption = Annotated[list[str] | None, typer.Option(
    "--lora-modules", help="LoRA adapters served by name (with --enable-lora), vLLM's list: "
    "`--lora-modules sql=/path/to/adapter chat=/other` or JSON '{\"name\": ..., \"path\": "
    "..., \"base_model_name\": ...}'; a request selects one by naming it as its model.")]
RuntimeLoraOption = Annotated[bool | None, typer.Option(
    "--allow-runtime-lora-updating/--no-allow-runtime-lora-updating",
    help="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: as vLLM, when "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING is true).")]
ChatTemplateOption = Annotated[str | None, typer.Option(
    "--chat-template", help="A chat template (a file, or the template itself) in place of the "
    "model's; a request's own chat_template still wins.")]
AutoToolChoiceOption = Annotated[bool, typer.Option(
    "--enable-auto-tool-choice", help="Serve tool_choice 'auto' (with --tool-call-parser): "
    "the model's own tool calls parsed from its answer.")]
ToolCallParserOption = Annotated[str | None, typer.Option(
    "--tool-call-parser", help="The model's tool-call syntax: hermes (Hermes, Qwen 2.5/3), "
    "llama3_json (Llama 3.1/3.2), pythonic (Llama 3.2/4), mistral.")]
ReasoningParserOption = Annotated[str | None, typer.Option(
    "--reasoning-parser", help="vLLM's reasoning parser: a reasoning model's thought comes back "
    "as the message's `reasoning`, apart from its content (deepseek_r1, qwen3).")]


def _check_front_end(chat_template: str | None, enable_auto_tool_choice: bool,
                     tool_call_parser: str | None, reasoning_parser: str | None = None,
                     lora_modules: list[str] | None = None) -> None:
    """The front-end options' errors, before any model loads (exit 2 naming the flag)."""
    from jpaged.server.lora_modules import parse_lora_modules
    from jpaged.server.reasoning_parsers import get_reasoning_parser
    from jpaged.server.serving import load_chat_template
    from jpaged.server.tool_parsers import auto_tool_parser

    try:
        auto_tool_parser(enable_auto_tool_choice, tool_call_parser)
        get_reasoning_parser(reasoning_parser)
        parse_lora_modules(lora_modules)
        if chat_template is not None:
            load_chat_template(chat_template)
    except ValueError as e:
        fail(str(e))


def _json_list(flag: str, value: str) -> list[str]:
    """A flag's JSON list of strings (exit 2 naming the flag otherwise)."""
    import json

    try:
        items = json.loads(value)
    except ValueError as e:
        fail(f"{flag} is not JSON: {e}")
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        fail(f"{flag} must be a JSON list of strings, got {value}")
    return items


def _with_model_tag(flags: dict[str, Any], model_tag: str | None) -> dict[str, Any]:
    """vLLM's `serve MODEL`: the positional model, unless --model names another (refused)."""
    if model_tag is None:
        return flags
    if flags.get("model") is not None and flags["model"] != model_tag:
        fail(f"the model is given twice: {model_tag!r} and --model {flags['model']!r}")
    return {**flags, "model": model_tag}


@with_engine_flags()
def serve(
    model_tag: Annotated[str | None, typer.Argument(
        metavar="[MODEL]", show_default=False,
        help="The model, as vLLM's `serve MODEL` (or --model).")] = None,
    host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = DEFAULT_PORT,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=["JPAGED_API_KEY", "VLLM_API_KEY"],
        help="Require 'Authorization: Bearer KEY' on /v1/* routes.")] = None,
    served_model_name: ServedModelNameOption = None,
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp",
        help="Engine replicas behind one router (each its own process, devices and cache).")
    ] = 1,
    data_parallel_backend: Annotated[str, typer.Option(
        "--data-parallel-backend", help="How replicas run: ray (the only backend).")] = "ray",
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Join this Ray cluster (default: start a local one).")] = None,
    routing_policy: Annotated[str, typer.Option(
        "--routing-policy", help="Data parallel, one of: kv_aware, round_robin, least_load.")
    ] = "kv_aware",
    prefill_replicas: Annotated[int, typer.Option(
        "--prefill-replicas",
        help="Disaggregated serving on Ray: replicas that only prefill (with "
        "--decode-replicas; the KV moves to a decode replica).")] = 0,
    decode_replicas: Annotated[int, typer.Option(
        "--decode-replicas",
        help="Disaggregated serving on Ray: replicas that pull a prompt's KV and decode.")] = 0,
    replica_dead_timeout_s: Annotated[float, typer.Option(
        "--replica-dead-timeout-s",
        help="Data parallel: exit non-zero once no replica has been healthy this long (Ray "
        "lost their node), so a supervisor restarts the server.")] = 60.0,
    enable_tokenizer_info_endpoint: Annotated[bool, typer.Option(
        "--enable-tokenizer-info-endpoint",
        help="Serve /tokenizer_info (the chat template, special and added tokens).")] = False,
    enable_server_load_tracking: Annotated[bool, typer.Option(
        "--enable-server-load-tracking",
        help="Count the generation requests in flight, served at /load.")] = False,
    enable_auto_tool_choice: AutoToolChoiceOption = False,
    tool_call_parser: ToolCallParserOption = None,
    chat_template: ChatTemplateOption = None,
    allowed_origins: Annotated[str, typer.Option(
        "--allowed-origins", help="CORS: the origins a browser page may call from, a JSON "
        "list (vLLM's; default every origin).")] = '["*"]',
    allow_credentials: Annotated[bool, typer.Option(
        "--allow-credentials", help="CORS: allow cookies and authorization headers.")] = False,
    max_stored_responses: Annotated[int, typer.Option(
        "--max-stored-responses", min=0,
        help="/v1/responses: how many answers are kept (the newest) for previous_response_id, "
        "retrieval and background runs; 0 keeps none.")] = DEFAULT_MAX_STORED_RESPONSES,
    enable_log_requests: Annotated[bool, typer.Option(
        "--enable-log-requests", help="Log each request as the engine takes it: its prompt, "
        "prompt ids and sampling parameters (vLLM's flag).")] = False,
    enable_log_outputs: Annotated[bool, typer.Option(
        "--enable-log-outputs", help="With --enable-log-requests, also log each finished "
        "output: its text, ids and finish reason.")] = False,
    max_log_len: Annotated[int | None, typer.Option(
        "--max-log-len", min=0, help="Cut logged prompts, outputs and id lists to this many "
        "characters / ids (default: whole).")] = None,
    reasoning_parser: ReasoningParserOption = None,
    lora_modules: LoraModulesOption = None,
    allow_runtime_lora_updating: RuntimeLoraOption = None,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/responses,
    /tokenize, /detokenize, /metrics)."""
    flags = _with_model_tag(engine_flags or {}, model_tag)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if run_worker_if_not_rank0(flags):
        return
    from jpaged.runner.multiprocess import ProcessGroupError, exit_now
    from jpaged.server import run_server

    _check_front_end(chat_template, enable_auto_tool_choice, tool_call_parser, reasoning_parser,
                     lora_modules)
    if lora_modules and not flags.get("enable_lora"):
        fail("--lora-modules needs --enable-lora")
    if enable_log_outputs and not enable_log_requests:
        fail("--enable-log-outputs needs --enable-log-requests (vLLM's rule)")
    origins = _json_list("--allowed-origins", allowed_origins)
    try:
        if data_parallel_backend != "ray":
            raise ValueError(f"--data-parallel-backend must be ray, got {data_parallel_backend!r}")
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
        if (data_parallel_size > 1 or ray_address is not None or prefill_replicas
                or decode_replicas):
            from jpaged.dp.client import DPEngineClient
            from jpaged.dp.router import ROUTING_POLICIES

            if routing_policy not in ROUTING_POLICIES:
                raise ValueError(f"--routing-policy must be one of {ROUTING_POLICIES}, "
                                 f"got {routing_policy!r}")
            engine = DPEngineClient(engine_args(flags), data_parallel_size, routing_policy,
                                    ray_address=ray_address, prefill_replicas=prefill_replicas,
                                    decode_replicas=decode_replicas,
                                    dead_timeout_s=replica_dead_timeout_s)
            engine.on_dead = _exit_cluster_lost
        else:
            engine = create_engine(engine_args(flags))
    except ProcessGroupError as e:
        exit_now(e)
        return
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    try:
        run_server(engine, host=host, port=port, api_key=api_key,
                   served_model_name=served_model_name or flags.get("model"),
                   enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
                   enable_server_load_tracking=enable_server_load_tracking,
                   enable_auto_tool_choice=enable_auto_tool_choice,
                   tool_call_parser=tool_call_parser, chat_template=chat_template,
                   allowed_origins=origins, allow_credentials=allow_credentials,
                   max_stored_responses=max_stored_responses,
                   enable_log_requests=enable_log_requests,
                   enable_log_outputs=enable_log_outputs, max_log_len=max_log_len,
                   reasoning_parser=reasoning_parser, lora_modules=lora_modules,
                   allow_runtime_lora_updating=allow_runtime_lora_updating)
    except (ValueError, FileNotFoundError) as e:  # an adapter that does not read, before start
        fail(str(e))
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass


def _exit_cluster_lost(cause: BaseException) -> None:
    """No replica can come back: stop Ray if this server started it (bounded), then exit 1."""
    import threading

    from jpaged.runner.multiprocess import exit_now

    threading.Timer(15.0, exit_now, (cause,)).start()  # a stuck Ray cannot keep us up
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        exit_now(cause)


@with_engine_flags()
def run_batch(
    input_file: Annotated[str, typer.Option(
        "--input-file", "-i", help="OpenAI batch file: JSON lines of {custom_id, method, url, "
        "body} ('-': stdin).")],
    output_file: Annotated[str, typer.Option(
        "--output-file", "-o", help="Where the answers go, a JSON line each, in input order "
        "('-': stdout).")],
    served_model_name: ServedModelNameOption = None,
    enable_auto_tool_choice: AutoToolChoiceOption = False,
    tool_call_parser: ToolCallParserOption = None,
    chat_template: ChatTemplateOption = None,
    reasoning_parser: ReasoningParserOption = None,
    lora_modules: LoraModulesOption = None,
    engine_flags: dict[str, Any] | None = None,
) -> None:
    """Answer an OpenAI batch file (/v1/completions, /v1/chat/completions and /v1/responses
    lines), as vLLM's run-batch: every line through the server's handlers in this process,
    batched."""
    import asyncio
    import json
    from pathlib import Path

    flags = engine_flags or {}
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The files first: a missing input or output directory fails before the model loads.
    try:
        lines = (sys.stdin.read() if input_file == "-"
                 else Path(input_file).read_text(encoding="utf-8")).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--input-file {input_file}: {e}")
    out_path = None if output_file == "-" else Path(output_file)
    if out_path is not None and not out_path.parent.is_dir():
        fail(f"--output-file {output_file}: its directory does not exist")
    _check_front_end(chat_template, enable_auto_tool_choice, tool_call_parser, reasoning_parser,
                     lora_modules)
    from jpaged.server import build_app
    from jpaged.server.run_batch import run_batch_lines

    try:
        engine = create_engine(engine_args(flags))
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    # A batch keeps no response (nobody can ask for one by id once the run ends).
    try:
        app = build_app(engine, served_model_name or flags.get("model"), owned=True,
                        enable_auto_tool_choice=enable_auto_tool_choice,
                        tool_call_parser=tool_call_parser, chat_template=chat_template,
                        max_stored_responses=0, reasoning_parser=reasoning_parser,
                        lora_modules=lora_modules)
    except (ValueError, FileNotFoundError) as e:
        engine.shutdown()
        fail(str(e))
    try:
        result = asyncio.run(run_batch_lines(app, lines))
    finally:
        app.state.engine.shutdown()
    answers = result.lines
    text = "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in answers)
    if out_path is None:
        sys.stdout.write(text)
    else:  # whole or not at all: a reader never sees half a file
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out_path)
    failed = sum(a["error"] is not None for a in answers)
    typer.echo(f"{len(answers)} requests: {len(answers) - failed} answered, {failed} failed "
               f"-> {output_file}", err=True)
    if result.malformed:  # as vLLM's, which stops on them: a failed run, though the rest ran
        lines_ = ", ".join(map(str, result.malformed[:10]))
        fail(f"--input-file {input_file}: line(s) {lines_} are no batch requests "
             "(their errors are in the output)")
