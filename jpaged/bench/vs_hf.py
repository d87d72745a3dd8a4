"""jpaged vs HF transformers on the same weights, prompts and output lengths (greedy, ignore_eos).

HF runs in PyTorch float32 on the CPU with `torch.set_num_threads` equal to the cores XLA:CPU
uses, two ways: `generate` on one left-padded batch of every prompt, and `generate_batch`, HF's
own paged continuous batching. Every request generates exactly `output_len` tokens. Throughput
is generated tokens / wall seconds of the whole batch; TTFT is per request (first token time −
submission), for `generate` the time its first new token reaches a streamer in the timed call
(one batch, so every request gets its first token at that moment). jpaged is
warmed on other prompts of the same lengths first, so its timed run compiles nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.loader import LoadedModel


def xla_cpu_threads() -> int:
    """Threads XLA:CPU runs a step on: one per core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def hf_twin(loaded: LoadedModel, directory: Path) -> Any:
    """An HF transformers causal LM (torch float32, eval) holding the loaded model's weights."""
    import torch
    import transformers

    from models.checkpoint import save_hf_dir

    spec = loaded.spec
    if spec.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"hf_twin supports Llama/Mistral checkpoints, got {spec.architecture}")
    save_hf_dir(loaded, directory)
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def run_jpaged(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str
               ) -> dict[str, Any]:
    """All prompts at once through the engine; tokens/s, per-request TTFT, the token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, arrival_time=t0)
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    wall = time.monotonic() - t0
    ordered = [outs[f"{tag}-{i}"] for i in range(len(prompts))]
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in ordered]
    tokens = [list(o.outputs[0].token_ids) for o in ordered]
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall,
            "ttft_s": float(np.median(ttft)), "token_ids": tokens}


def _first_token_clock() -> Any:
    """A `generate` streamer that notes when the first new tokens arrive (after the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.puts = 0
            self.first_token_at: float | None = None

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == 2:  # put 1 is the prompt batch; put 2 the first sampled tokens
                self.first_token_at = time.perf_counter()

        def end(self) -> None:
            pass

    return FirstTokenClock()


def run_hf_generate(model: Any, prompts: list[list[int]], output_len: int, pad_id: int
                    ) -> dict[str, Any]:
    """One left-padded `generate` batch; TTFT from a streamer inside the same timed call."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    clock = _first_token_clock()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
                             eos_token_id=None, max_new_tokens=output_len,
                             min_new_tokens=output_len, streamer=clock)
        wall = time.perf_counter() - t0
    if clock.first_token_at is None:
        raise RuntimeError("HF generate never streamed a generated token; cannot time TTFT")
    tokens = out[:, width:].tolist()
    # t0 <= first_token_at <= the end of the call, so 0 < ttft <= wall holds by construction.
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall,
            "ttft_s": clock.first_token_at - t0, "token_ids": tokens}


def run_hf_generate_batch(model: Any, prompts: list[list[int]], output_len: int, pad_id: int,
                          cache_blocks: int | None = None) -> dict[str, Any]:
    """HF continuous batching (`generate_batch`, its paged cache); per-request TTFT.

    `cache_blocks`: the size of HF's paged cache in its blocks (None: HF sizes it from free
    memory, as the benchmark runs it; on the CPU that allocates several GiB inside the call).
    """
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=pad_id)
    with torch.no_grad():
        t0 = time.perf_counter()
        # warmup=False: its warm-up pre-captures CUDA graphs, moot on the CPU, and would run
        # max-size forwards inside every timed call.
        cb = (ContinuousBatchingConfig(num_blocks=cache_blocks) if cache_blocks is not None
              else None)
        res = model.generate_batch(prompts, generation_config=cfg, record_timestamps=True,
                                   progress_bar=False, warmup=False,
                                   continuous_batching_config=cb)
        wall = time.perf_counter() - t0
    # generate_batch keys results by request id; prompts identify them.
    by_prompt = {tuple(r.prompt_ids): r for r in res.values()}
    ordered = [by_prompt[tuple(p)] for p in prompts]
    ttft = [r.timestamps[0] - r.created_time for r in ordered if r.timestamps]
    tokens = [list(r.generated_tokens) for r in ordered]
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall,
            "ttft_s": float(np.median(ttft)) if ttft else float("nan"), "token_ids": tokens}


def jpaged_engine(loaded: LoadedModel, max_model_len: int, num_seqs: int) -> LLMEngine:
    """The engine the comparison uses: prefix caching off (the prompts share nothing)."""
    return LLMEngine(EngineArgs(max_model_len=max_model_len, max_num_seqs=max(num_seqs, 1),
                                enable_prefix_caching=False, disable_log_stats=True),
                     loaded=loaded)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1)
