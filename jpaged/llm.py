"""LLM: the notebook API (vLLM's offline `LLM` class)."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jpaged.beam_search import BeamSearch, BeamSearchOutput
from jpaged.config import EngineArgs
from jpaged.core_client import create_engine
from jpaged.engine import LLMEngine, PromptType
from jpaged.lora_request import LoRARequest
from jpaged.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jpaged.pooling_params import PoolingParams, check_cross_encoder, cross_encoder_prompt
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from models.tokenizer import message_text, template_tool_calls

Messages = list[Mapping[str, Any]]


class LLM:
    """Generate from a model with the paged engine: `LLM(model=None, **engine_args)`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}; valid ones: "
                            f"{sorted(EngineArgs.field_names())}")
        kwargs.setdefault("disable_log_stats", True)  # offline use: no periodic stats (vLLM)
        self.llm_engine = create_engine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built over an already loaded model)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation-config defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; see
        EngineArgs.generation_config), what
        `generate(prompts)` without sampling_params uses."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order. `priority`: one per
        prompt, or one value for all (lower runs first, as vLLM's priority scheduling);
        `lora_request`: one LoRA adapter for all, or one (or None) per prompt."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:  # as vLLM: the model's generation-config defaults
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            listed = isinstance(sampling_params, Iterable) and not isinstance(
                sampling_params, str | Mapping)
            params_list = list(sampling_params) if listed else [sampling_params]
            for p in params_list:
                if not isinstance(p, SamplingParams):
                    raise ValueError("sampling_params must be a SamplingParams or a list of "
                                     f"them, got {type(p).__name__}")
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} "
                                 "prompts; pass one or one per prompt")
        if isinstance(priority, int) and not isinstance(priority, bool):
            priority = [priority] * len(prompts)  # one value for every prompt, as vLLM
        elif priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority must have one entry per prompt (or be one integer), "
                             f"got {len(priority)} for {len(prompts)} prompts")
        return self._run(prompts, params_list, priority, use_tqdm,
                         _lora_list(lora_request, len(prompts)))

    def _run(self, prompts: list[PromptType], params_list: Sequence[SamplingParams | PoolingParams],
             priority: Sequence[int] | None, use_tqdm: bool | Callable[..., Any],
             loras: Sequence[LoRARequest | None] | None = None) -> list[Any]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = f"gen-{next(self._ids)}"
                if isinstance(params, SamplingParams):
                    params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(rid, prompt, params,
                                   priority=priority[i] if priority is not None else 0,
                                   lora_request=loras[i] if loras is not None else None)
                order[rid] = i
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # a bad prompt leaves nothing half-queued
            raise
        results: list[Any] = [None] * len(prompts)
        bar = _progress(len(prompts), use_tqdm)
        try:
            while engine.has_unfinished_requests() and any(r is None for r in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(added)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """A pooling engine's vectors of the prompts (vLLM's `LLM.encode`), in input order:
        each prompt runs once and its final hidden states pool as the engine's pooler says
        (runner="pooling"); `truncate_prompt_tokens` keeps each prompt's first k tokens.
        `pooling_task` (vLLM's): the model's own task, "embed" for an embedding model,
        "classify" or "score" for a classifier; None: whichever it is."""
        _check_task(pooling_task, self.llm_engine.spec)
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts) or not all(
                    isinstance(p, PoolingParams) for p in params_list):
                raise ValueError("pooling_params must be a PoolingParams or one per prompt")
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]
        outs = self._run(prompts, params_list, None, use_tqdm,
                         _lora_list(lora_request, len(prompts)))
        for out in outs:
            if out.outputs is None:
                raise RuntimeError(f"request {out.request_id} has no vector: {out.error}")
        return outs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (vLLM's `LLM.embed`): `encode`'s vectors as lists of
        floats (`.outputs.embedding`)."""
        spec = self.llm_engine.spec
        if spec.labels:
            raise ValueError(f"embed needs an embedding model; this is a sequence classifier "
                             f"({spec.hf_architecture}): use LLM.classify or LLM.score")
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, lora_request=lora_request)]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities of each prompt (vLLM's
        `LLM.classify`; `.outputs.probs`, one per label in the model's id2label order):
        softmax of its score head's logits (sigmoid of one label; raw with
        PoolingParams(use_activation=False))."""
        spec = self.llm_engine.spec
        if not spec.labels:
            raise ValueError("classify needs a sequence classifier (a *ForSequenceClassification "
                             "checkpoint); this model is not one: use LLM.embed")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, lora_request=lora_request)]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs (vLLM's `LLM.score`): one `data_1` against each of `data_2`,
        or pair i of two lists of the same length. An embedding model's score is the cosine
        similarity of the two texts' vectors; a cross-encoder's (a one-label sequence
        classifier, e.g. a reranker) the probability its head gives the pair read as one
        prompt (`cross_encoder_prompt`)."""
        left, right = _prompt_list(data_1), _prompt_list(data_2)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right) or not right:
            raise ValueError(f"score takes one data_1 and any number of data_2, or lists of the "
                             f"same length; got {len(left)} and {len(right)}")
        spec = self.llm_engine.spec
        if spec.labels:
            check_cross_encoder(spec)
            tokenizer = self.get_tokenizer()
            pairs = [cross_encoder_prompt(tokenizer, a, b)
                     for a, b in zip(left, right, strict=True)]
            outs = self.encode(pairs, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, lora_request=lora_request)
            return [ScoringRequestOutput(f"score-{next(self._ids)}",
                                         ScoringOutput(float(o.outputs.data[0])),
                                         o.prompt_token_ids) for o in outs]
        embs = self.encode([*left, *right], PoolingParams(normalize=True),
                           truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request)
        n = len(left)
        out = []
        for i in range(n):
            a, b = embs[i], embs[n + i]
            score = float(np.dot(a.outputs.data, b.outputs.data))  # unit vectors: the cosine
            out.append(ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(score),
                                            a.prompt_token_ids + b.prompt_token_ids))
        return out

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: each prompt's `params.beam_width` best sequences (prompt and
        output tokens, their text, cumulative logprob), best first. Each step runs every live
        beam as a one-token request (`lora_request`: all with that LoRA adapter); the prefix
        cache keeps what the beams share."""
        prompts = _prompt_list(prompts)
        engine = self.llm_engine
        search = BeamSearch(len(prompts), params, engine.eos_token_ids,
                            engine.config.scheduler.max_model_len,
                            engine.logprobs_limit)
        bar = _progress(params.max_tokens, use_tqdm)
        try:
            while not search.done:
                batch = search.requests() or prompts
                search.advance(self._run(batch, [search.step_params] * len(batch), None, False,
                                         _lora_list(lora_request, len(batch))))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        results = search.results()
        tokenizer = self.get_tokenizer()
        for out in results:
            for seq in out.sequences:  # the whole sequence, special tokens kept (vLLM's text)
                seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=False)
        return results

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        As vLLM's: a message's content is a string, a list of text parts or None;
        `chat_template` replaces the model's, `chat_template_kwargs` and `tools` reach it as
        variables, and `continue_final_message` (with add_generation_prompt=False) leaves the
        last message open for the model to continue."""
        if not messages:
            raise ValueError("messages is empty")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        tok = self.get_tokenizer()
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts: list[PromptType] = []
        for conv in convs:
            msgs = []
            for m in conv:
                if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                    raise ValueError("each chat message must be a dict with a string 'role'")
                msg = {**m, "content": message_text(m.get("content"))}
                if m.get("tool_calls") is not None:  # arguments as objects, as vLLM's
                    msg["tool_calls"] = template_tool_calls(m["tool_calls"])
                msgs.append(msg)
            text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template,
                                           continue_final_message=continue_final_message,
                                           **extra)
            # The template already holds the special tokens; do not add a BOS again.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def get_metrics(self) -> dict[str, Any]:
        """Preemptions, KV usage, prefix-cache hit rate and other engine metrics."""
        return self.llm_engine.get_metrics()

    def cache_state(self) -> dict[str, Any]:
        """A read-only, JSON-serialisable snapshot of the KV pool (plot it with jpaged.viz).

        Keys (lists indexed by physical block id, 0 .. num_blocks-1; block 0 is the null block):

        - ``version``, ``num_blocks`` (null block included), ``block_size`` (tokens per block)
        - ``status``: per-block code, 0 null, 1 free, 2 free but cached (reusable prefix),
          3 in use; ``status_names`` spells them out
        - ``ref_counts``, ``num_tokens`` (slots filled), ``cached`` (holds a prefix hash)
        - ``owners``: per block, the ids of the requests whose block table holds it
          (more than one: a shared prefix block)
        - ``requests``: for each request holding blocks, ``block_table`` (logical -> physical
          ids), ``num_tokens``, ``num_computed_tokens``, ``num_prompt_tokens``,
          ``num_output_tokens``, ``priority``, ``status``, ``user_request_id`` (the id given
          to generate/add_request; differs from the key only for n > 1 children)
        - ``waiting``: ids of queued requests holding no blocks; ``swapped``: {id: tokens}
          of those whose KV waits in the host tier (swap preemption)
        - ``cached_blocks``: {prefix hash (hex, first 16 chars): block id}
        - ``free_queue``: free block ids in eviction order (first = evicted first)
        - ``num_free_blocks``, ``num_cached_free_blocks``, ``num_in_use_blocks``, ``usage``
        - ``prefix_caching``, ``prefix_cache_hit_rate``, ``prefix_cache_hits``,
          ``prefix_cache_queries`` (tokens)
        - ``tiers``: the host/disk KV tier entries of get_metrics() (zeros without tiers)
        """
        return self.llm_engine.cache_state()

    def metrics_history(self) -> list[dict[str, Any]]:
        """Per-step points (oldest first, bounded): time, KV usage, queues, preemptions, tokens."""
        return self.llm_engine.metrics_history.snapshot()

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode (needs enable_sleep_mode=True and no unfinished request): the
        device memory of the KV cache and the weights given back (level 1: weights kept on
        the host; level 2: read again at wake_up); returns the bytes let go."""
        return self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back after `sleep`: "weights", "kv_cache" or both."""
        self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefix blocks, on the device and in the host tier (only when no
        request holds them). The disk tier is kept: a persistent cache under a fingerprint of
        the weights, dtype, block size and scales, which changed weights already change;
        delete its folder under kv_cache_dir to empty it."""
        return self.llm_engine.reset_prefix_cache()


def _lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
               ) -> list[LoRARequest | None] | None:
    """One LoRARequest (or None) per prompt, from one for all or a list of them."""
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * n
    if isinstance(lora, str | Mapping) or not isinstance(lora, Iterable):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got "
                         f"{type(lora).__name__}")
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts; pass one "
                         "or one per prompt")
    return loras


# vLLM's pooling tasks, and the ones a model of each kind serves here.
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")


def _check_task(task: str | None, spec: Any) -> None:
    """ValueError naming the task unless the model serves it (None: any model's own)."""
    if task is None:
        return
    if task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got "
                         f"{task!r}")
    own = ("classify", "score") if spec.labels else ("embed",)
    if task not in own:
        kind = "a sequence classifier" if spec.labels else "an embedding model"
        raise ValueError(f"pooling_task {task!r} is not served: this model is {kind}, whose "
                         f"tasks are {', '.join(own)} (token-level pooling is not supported)")


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a str or a prompt dict) or an iterable of them, as a list."""
    if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, list) and prompts and all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts)):
        return [prompts]  # one prompt (vLLM's prompt_to_seq: a list of ints is one)
    if not isinstance(prompts, Iterable):
        raise ValueError("prompts must be a str, a prompt dict or a list of them, got "
                         f"{type(prompts).__name__}")
    return list(prompts)


def _progress(total: int, use_tqdm: bool | Callable[..., Any]) -> Any:
    """None, or a tqdm-like bar (update(n), close()): `use_tqdm` itself when it is a callable
    (a tqdm class or factory, as vLLM accepts), else a rich bar on stderr."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    return RichProgressBar(total=total, desc="Processed prompts")


class RichProgressBar:
    """A tqdm-like progress bar drawn by rich on stderr: `RichProgressBar(total=..., desc=...)`."""

    def __init__(self, total: int, desc: str = "", **_: Any) -> None:
        from rich import progress as rp
        from rich.console import Console

        self._progress = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                                     rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                                     rp.TimeRemainingColumn(), console=Console(stderr=True))
        self._task = self._progress.add_task(desc, total=total)
        self._progress.start()

    def update(self, n: int = 1) -> None:
        """Count n more finished requests."""
        self._progress.advance(self._task, n)

    def close(self) -> None:
        """Stop drawing (the final state stays on a terminal)."""
        self._progress.stop()
