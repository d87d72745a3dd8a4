"""LLM: the notebook API (vLLM's offline `LLM` class)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jpaged.config import EngineArgs
from jpaged.engine import LLMEngine, PromptType
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams

Messages = list[Mapping[str, Any]]


class LLM:
    """Generate from a model with the paged engine: `LLM(model=None, **engine_args)`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}; valid ones: "
                            f"{sorted(EngineArgs.field_names())}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
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

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} "
                                 "prompts; pass one or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        return self._run(prompts, params_list, priority, use_tqdm)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             priority: Sequence[int] | None, use_tqdm: bool | Callable[..., Any]
             ) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = f"gen-{next(self._ids)}"
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(rid, prompt, params,
                                   priority=priority[i] if priority is not None else 0)
                order[rid] = i
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # a bad prompt leaves nothing half-queued
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = _progress(len(prompts), use_tqdm)
        try:
            while engine.has_unfinished_requests() and any(r is None for r in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.advance(bar.task_ids[0])
        except BaseException:
            engine.abort_request(added)
            raise
        finally:
            if bar is not None:
                bar.stop()
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("messages is empty")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in convs:
            for m in conv:
                if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                    raise ValueError("each chat message must be a dict with 'role' and 'content'")
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            # The template already holds the special tokens; do not add a BOS again.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """Preemptions, KV usage, prefix-cache hit rate and other engine metrics."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefix blocks (only when no request holds them)."""
        return self.llm_engine.reset_prefix_cache()


def _progress(total: int, use_tqdm: bool | Callable[..., Any]) -> Any:
    if not use_tqdm:
        return None
    from rich.progress import Progress

    bar = Progress(transient=True)
    bar.add_task("generating", total=total)
    bar.start()
    return bar
