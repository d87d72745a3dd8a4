"""The `jpaged` command line (typer); thin over the package."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from jpaged.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS

app = typer.Typer(help="jpaged: a JAX inference engine with a vLLM-style paged KV cache.",
                  no_args_is_help=True, add_completion=False)

Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="HF directory, .gguf file or hub repo id (default: embedded SmolLM2).")]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block (power of 2).")]
GpuMem = Annotated[float, typer.Option("--gpu-memory-utilization",
                                       help="Fraction of device memory for weights + KV pool.")]
KvBytes = Annotated[int | None, typer.Option(
    "--kv-cache-memory-bytes", help="KV pool size in bytes (overrides the fraction).")]
Prefix = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                      help="Reuse KV blocks of shared prompt prefixes.")]
KvDtype = Annotated[str, typer.Option("--kv-cache-dtype",
                                      help="auto|float32|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2")]
Swap = Annotated[float, typer.Option("--swap-space", help="Disk tier size in GiB.")]
Offload = Annotated[float, typer.Option("--kv-offloading-size", help="Host RAM tier in GiB.")]
MaxSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Max sequences per step.")]
MaxTokens = Annotated[int | None, typer.Option("--max-num-batched-tokens",
                                               help="Token budget per step.")]
MaxLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length limit.")]
TP = Annotated[int, typer.Option("--tensor-parallel-size", help="Devices for tensor parallelism.")]
Preempt = Annotated[str, typer.Option("--preemption-mode", help="recompute|swap")]
Backend = Annotated[str, typer.Option("--attention-backend", help="auto|pallas|reference")]
Seed = Annotated[int, typer.Option("--seed", help="Engine seed.")]
Blocks = Annotated[int | None, typer.Option("--num-gpu-blocks-override",
                                            help="Exact KV pool size in blocks.")]


@app.callback()
def _root() -> None:
    """jpaged: a JAX inference engine with a vLLM-style paged KV cache."""


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


@app.command()
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete.")] = None,
    model: Model = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = -1,
    n: Annotated[int, typer.Option("--n", help="Completions per prompt.")] = 1,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt.")] = False,
    input_file: Annotated[Path | None, typer.Option("--input",
                                                    help="JSONL file of {'prompt': ...}.")] = None,
    output_file: Annotated[Path | None, typer.Option("--output",
                                                     help="Write JSONL results here.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log to stderr.")] = False,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    gpu_memory_utilization: GpuMem = 0.9,
    kv_cache_memory_bytes: KvBytes = None,
    enable_prefix_caching: Prefix = True,
    kv_cache_dtype: KvDtype = "auto",
    swap_space: Swap = 0.0,
    kv_offloading_size: Offload = 0.0,
    max_num_seqs: MaxSeqs = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: MaxTokens = None,
    max_model_len: MaxLen = None,
    tensor_parallel_size: TP = 1,
    preemption_mode: Preempt = "recompute",
    attention_backend: Backend = "auto",
    seed: Seed = 0,
    num_gpu_blocks_override: Blocks = None,
) -> None:
    """Complete prompts with the paged engine (chat template applied unless --raw)."""
    _setup_logging(verbose)
    texts = list(prompts or [])
    if input_file is not None:
        if not input_file.exists():
            _fail(f"--input file not found: {input_file}")
        for lineno, line in enumerate(input_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                texts.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
            except (json.JSONDecodeError, KeyError) as e:
                _fail(f"{input_file}:{lineno}: expected a JSON object with 'prompt' ({e})")
    if not texts:
        _fail("give at least one PROMPT or --input FILE")
    from jpaged.llm import LLM
    from jpaged.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_tokens, seed=seed)
        llm = LLM(model, block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                  kv_cache_memory_bytes=kv_cache_memory_bytes,
                  enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                  swap_space=swap_space, kv_offloading_size=kv_offloading_size,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                  preemption_mode=preemption_mode, attention_backend=attention_backend,
                  seed=seed, num_gpu_blocks_override=num_gpu_blocks_override)
        tok = llm.get_tokenizer()
        inputs: list[Any] = []
        for t in texts:
            if raw or not tok.has_chat_template:
                inputs.append(t)
            else:
                templ = tok.apply_chat_template([{"role": "user", "content": t}])
                inputs.append({"prompt": t,
                               "prompt_token_ids": tok.encode(templ, add_special_tokens=False)})
        outs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1 and sys.stderr.isatty())
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
        return
    sink = output_file.open("w") if output_file is not None else None
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


def main() -> None:
    """Entry point for `python -m jpaged.cli`."""
    app()


if __name__ == "__main__":
    main()
