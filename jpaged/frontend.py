"""The request side of an engine: validate and tokenize prompts, fan n > 1 out into sequences,
and turn each step's sampled tokens into RequestOutputs (text, stop strings, logprobs).

`LLMEngine` runs it beside its scheduler in one process; `CoreProcessEngine`
(jpaged/engine_core.py) runs it in the user's process while the scheduler and the device step
run in an engine-core process, as vLLM V1 splits them.
"""

from __future__ import annotations

import functools
import logging
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jpaged.config import EngineConfig
from jpaged.core.kv_connector import check_kv_transfer_params
from jpaged.core.structured_output import GrammarCompiler, make_grammar_compiler
from jpaged.lora_request import LoRARequest
from jpaged.metrics import StatLogger
from jpaged.output_processor import (
    ChildState,
    RequestGroup,
    finish_text,
    make_output,
    num_output_tokens,
    prompt_logprobs_of,
    record_logprobs,
    update_child,
)
from jpaged.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from jpaged.pooling_params import PoolerConfig, PoolingParams, pool
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.config import ModelSpec
from models.loader import sampling_defaults
from models.lora import LoraCache

logger = logging.getLogger("jpaged")

PromptType = str | Mapping[str, Any]


def _token_id_list(ids: Any) -> list[Any]:
    """`prompt_token_ids` as a list (any iterable but a string or a mapping), else ValueError."""
    if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {ids!r}")
    return list(ids)



def truncation_keep(truncate: int, max_model_len: int) -> int:
    """How many prompt tokens truncate_prompt_tokens keeps: k, or with -1 all that leave room
    for one generated token (vLLM's rule)."""
    return max_model_len - 1 if truncate == -1 else truncate


def truncated(ids: list[int], truncate: int, max_model_len: int, side: str = "left"
              ) -> list[int]:
    """The prompt tokens truncate_prompt_tokens keeps, the one rule engine and server share:
    truncation_keep() of them, the last ones (side "left", vLLM's default: the start is cut)
    or the first ones ("right")."""
    keep = truncation_keep(truncate, max_model_len)
    if len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


class RequestFrontend:
    """add_request / abort_request and output processing, over a scheduler reached by hooks.

    A subclass sets `tokenizer`, `spec`, `config` and calls `_init_frontend()` (which makes its
    `stat_logger`); it implements `_submit` (queue new sequences) and `_finish` (end sequences
    early).
    """

    tokenizer: Any
    spec: ModelSpec
    config: EngineConfig
    stat_logger: StatLogger

    def _init_frontend(self, log_stats: bool = True, lora_cache: LoraCache | None = None
                       ) -> None:
        # Request timing histograms + the periodic stats log line (fed once per step).
        sched = self.config.scheduler
        self.stat_logger = StatLogger(self.get_metrics, log=log_stats,
                                      max_model_len=sched.max_model_len,
                                      max_num_batched_tokens=sched.max_num_batched_tokens)
        c = self.config.cache
        self.stat_logger.set_cache_config(
            block_size=c.block_size, cache_dtype=c.kv_cache_dtype,
            num_gpu_blocks=c.num_gpu_blocks, enable_prefix_caching=c.enable_prefix_caching,
            prefix_caching_hash_algo=c.prefix_caching_hash_algo)
        self._groups: dict[str, RequestGroup] = {}
        # runner "pooling": how the core pools prompts (None: a generating engine; set by the
        # engine before this).
        self.pooler: PoolerConfig | None = getattr(self, "pooler", None)
        # Scheduler request id (a child's, for n > 1) -> its user request and output state.
        self._child_of: dict[str, tuple[RequestGroup, ChildState]] = {}
        self._counter = 0
        # Token and step counters live in the scheduler; these count user-level requests.
        self.stats = {"num_requests_finished": 0, "num_requests_aborted": 0}
        # LoRA adapters as the front end checks them (an in-process engine's core reads
        # through the same cache); None when LoRA is off.
        lora = self.config.lora
        self._lora_cache = lora_cache if lora_cache is not None or lora is None else LoraCache(
            self.spec, lora.max_lora_rank, lora.host_capacity)
        self._lora_names: dict[int, str] = {}  # lora_int_id -> name, of adapters checked

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse a LoRARequest this engine cannot run (ValueError or FileNotFoundError naming
        the problem): LoRA off, or an adapter that does not read or does not fit the model."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self._lora_cache is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled "
                             "(start the engine with enable_lora=True, --enable-lora)")
        other = self._lora_names.get(lora_request.lora_int_id)
        if other is not None and other != lora_request.lora_name:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: lora_int_id "
                             f"{lora_request.lora_int_id} is adapter {other!r}'s; each adapter "
                             "needs an id of its own")
        self._lora_cache.get(lora_request.lora_name, lora_request.lora_path)
        self._lora_names[lora_request.lora_int_id] = lora_request.lora_name

    def drop_lora(self, name: str) -> bool:
        """Drop adapter `name`'s host copy (the server's unload); False when none was held."""
        return self._lora_cache is not None and self._lora_cache.drop(name)

    # vLLM's LLMEngine adapter calls, on the host copies this front end holds.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (errors as `check_lora`)."""
        self.check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the host copy of the adapter with this lora_int_id; False when none is held."""
        name = self._lora_names.get(lora_id)
        return name is not None and self.drop_lora(name)

    def lora_id_for(self, name: str) -> int:
        """The lora_int_id of adapter `name` if this engine has checked it, else one no
        adapter has (the server numbers its adapters so)."""
        known = [i for i, n in self._lora_names.items() if n == name]
        return known[0] if known else max(self._lora_names, default=0) + 1

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters held on the host."""
        cache = self._lora_cache
        return {i for i, n in self._lora_names.items() if cache is not None and n in cache}

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter with this lora_int_id on the host whatever max_cpu_loras says
        (ValueError when none is held, as vLLM's)."""
        name = self._lora_names.get(lora_id)
        if name is None or self._lora_cache is None or not self._lora_cache.pin(name):
            raise ValueError(f"pin_lora: no LoRA adapter with lora_int_id {lora_id} is held")
        return True

    def front_metrics(self) -> dict[str, Any]:
        """The front end's counters, beside the core's in get_metrics: user-level requests,
        and vLLM's prompt_tokens (the stat logger's count)."""
        return {**self.stats, "request_prompt_tokens_total": self.stat_logger.prompt_tokens}

    def _submit(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def is_sleeping(self) -> bool:
        """True while the engine sleeps (sleep mode); a front end without it never does."""
        return False

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        raise NotImplementedError

    def _check_params(self, params: SamplingParams) -> None:
        """Checks of a request's params that need the engine's config (ValueError naming the
        problem): kv_transfer_params against its KV connector; a structured output's grammar
        compiles (cached, so the engine's own matcher costs a copy)."""
        kvp = (params.extra_args or {}).get("kv_transfer_params")
        check_kv_transfer_params(kvp, self.config.kv_transfer, params.n)
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)

    def _bad_words_tokens(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad_words: each word as it is, and with one leading space
        when that gives other tokens of the same count (so it is banned mid-text too)."""
        out: list[tuple[int, ...]] = []
        for word in words or ():
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if bare:
                out.append(bare)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                out.append(spaced)
        return tuple(out)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a request (unless ignore_eos): the tokenizer's EOS first (the
        primary one, as vLLM's), then the model's others (config and generation_config)."""
        first = self.tokenizer.eos_token_id
        if first is None:
            return tuple(self.spec.eos_token_ids)
        return (first, *(t for t in self.spec.eos_token_ids if t != first))

    @functools.cached_property
    def default_sampling(self) -> dict[str, Any]:
        """vLLM's default sampling parameters of a request that leaves them unset: the model's
        generation_config.json ones (`generation_config` "auto"), none ("vllm"), or those of a
        directory's generation_config.json; its max_new_tokens is max_tokens here."""
        where = self.config.model.generation_config
        if where == "vllm":
            return {}
        found = (getattr(self.loaded, "generation_config", None) or {} if where == "auto"
                 else sampling_defaults(where))
        if found:
            logger.info("default sampling parameters from the model's generation config: %s "
                        "(--generation-config vllm to use SamplingParams' own)", found)
        return dict(found)

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs a request may ask for: max_logprobs, or with -1 the vocabulary."""
        return self.config.model.logprobs_limit(self.spec.vocab_size)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' grammars for this model's tokenizer (made on first use)."""
        gc = getattr(self, "_grammar_compiler", None)
        if gc is None:
            gc = self._grammar_compiler = make_grammar_compiler(
                self.tokenizer, self.spec.eos_token_ids, self.spec.vocab_size,
                self.config.structured_outputs)
        return gc

    # ----------------------------------------------------------------- requests
    def _tokenize(self, prompt: PromptType, truncate: int | None = None, side: str = "left"
                  ) -> tuple[str | None, list[int], str | None]:
        salt = None
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), _token_id_list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, list):  # vLLM: a list of token ids is a TokensPrompt
            text, ids = None, _token_id_list(prompt)
        else:
            raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            if not text:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.spec.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids[{i}] is {t!r}, out of vocabulary: token "
                                 f"ids must be integers in [0, {vocab})")
        ids = [int(t) for t in ids]  # numpy integers become Python ints
        max_len = self.config.scheduler.max_model_len
        if truncate is not None:  # vLLM: k tokens (-1: all that leave room), from its side
            kept = truncated(ids, truncate, max_len, side)
            if len(kept) < len(ids):
                ids, text = kept, None
        if len(ids) >= max_len:
            room = ("a pooling model's prompt may have max_model_len - 1 tokens (the last "
                    "position is the engine's own)" if self.pooler is not None else
                    "it must leave room for at least one generated token")
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_len}: "
                             f"{room}")
        return text, ids, salt

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate, tokenize and queue a request; n > 1 fans out into n sequences
        (`lora_request`: the LoRA adapter it runs with, None for the base model). A pooling
        engine takes PoolingParams (None: the defaults) and pools the prompt instead."""
        if not isinstance(request_id, str):  # as vLLM: abort and outputs key on the string
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.is_sleeping():
            raise ValueError("the engine is sleeping (sleep mode): call wake_up() first")
        if self.pooler is not None or isinstance(params, PoolingParams):
            self._add_pooling(request_id, prompt, params, priority, arrival_time, lora_request)
            return
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        vocab = self.spec.vocab_size
        limit = self.logprobs_limit
        whole: dict[str, int] = {}  # -1 (the whole vocabulary, vLLM's) as that many tokens
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and (vocab if k == -1 else k) > limit:
                asked = f"the whole vocabulary ({vocab} logprobs)" if k == -1 else f"{k} logprobs"
                raise ValueError(f"SamplingParams.{name} asks for {asked}, more than "
                                 f"the engine's max_logprobs ({self.config.model.max_logprobs}) "
                                 "allows (vLLM's --max-logprobs; -1: the whole vocabulary)")
            if k == -1:
                whole[name] = vocab
        if whole:  # past here every count is a number of candidates
            params = params.clone(**whole)
        self._check_params(params)
        self.check_lora(lora_request)
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            for t in ids or ():
                if not 0 <= t < vocab:
                    raise ValueError(f"SamplingParams.{name} holds {t}: token ids must be in "
                                     f"the vocabulary [0, {vocab})")
        text, ids, salt = self._tokenize(prompt, params.truncate_prompt_tokens,
                                         params.truncation_side)
        eos = self.eos_token_ids
        max_len = self.config.scheduler.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        base = params.clone(eos_token_ids=eos, max_tokens=max_tokens,
                            bad_words_token_ids=self._bad_words_tokens(params.bad_words))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, text, ids, base, arrival_time=arrival)
        for i in range(params.n):
            self._counter += 1
            seed = (params.seed + i) if params.seed is not None else (
                self.config.model.seed * 1_000_003 + self._counter)
            seed = (seed + 2**63) % 2**64 - 2**63  # stays a 64-bit seed (SamplingParams' range)
            child_params = base.clone(n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, ids, child_params, priority=priority, arrival_time=arrival,
                          cache_salt=salt, lora_request=lora_request)
            group.children.append(ChildState(
                i, req, logprobs=[] if params.logprobs is not None else None))
        self._submit([c.request for c in group.children])  # raises before anything is kept
        self._groups[request_id] = group
        for c in group.children:
            self._child_of[c.request.request_id] = (group, c)

    def _add_pooling(self, request_id: str, prompt: PromptType, params: Any, priority: int,
                     arrival_time: float | None, lora_request: LoRARequest | None) -> None:
        """add_request of a pooling engine: the prompt runs once (one internal greedy token,
        never shown, ends it) and its final hidden states are pooled (EngineCore)."""
        if self.pooler is None:
            raise ValueError("PoolingParams need a pooling engine (runner='pooling', vLLM's "
                             "--runner pooling); this engine generates")
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            what = ("classifies prompts (LLM.classify, LLM.score; the server's /classify, "
                    "/score, /rerank)" if self.spec.labels else "embeds prompts (LLM.embed, "
                    "LLM.encode, LLM.score; the server's /v1/embeddings)")
            raise ValueError(f"this engine runs a pooling model (runner='pooling'): it {what}, "
                             f"it does not generate; got {type(params).__name__}")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        params.check(self.spec.hidden_size, self.spec.num_labels)
        max_len = self.config.scheduler.max_model_len
        t = params.truncate_prompt_tokens
        if t is not None and t > max_len:  # vLLM: whatever the prompt's length
            raise ValueError(f"PoolingParams.truncate_prompt_tokens is {t}, greater than "
                             f"max_model_len ({max_len}): request a smaller truncation size")
        self.check_lora(lora_request)
        # vLLM's pooling runner truncates on the right (its tokenizer's truncation_side).
        text, ids, salt = self._tokenize(prompt, params.truncate_prompt_tokens, "right")
        inner = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                               output_kind=RequestOutputKind.FINAL_ONLY)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, text, ids, inner, arrival_time=arrival,
                             pooling=params)
        req = Request(request_id, ids, inner, priority=priority, arrival_time=arrival,
                      cache_salt=salt, lora_request=lora_request,
                      pooling=self.pooler.pooling_type)
        group.children.append(ChildState(0, req))
        self._submit([req])
        self._groups[request_id] = group
        self._child_of[request_id] = (group, group.children[0])

    def _group_output(self, group: RequestGroup, finished: bool
                      ) -> RequestOutput | PoolingRequestOutput | None:
        """The group's output of this step: a RequestOutput, or for a pooling request its
        PoolingRequestOutput once finished (its vector, or None with the reason it has none)."""
        if group.pooling is None:
            return make_output(group, finished)
        if not finished:
            return None
        child = group.children[0]
        req = child.request
        if req.pooled is not None and child.finish_reason not in ("abort", "error"):
            data = pool(req.pooled, group.pooling, self.pooler,
                        (self.spec.problem_type or "") if self.spec.labels else None)
            return PoolingRequestOutput(group.request_id, PoolingOutput(data),
                                        group.prompt_token_ids, True, req.num_cached_tokens)
        why = child.stop_reason if child.finish_reason == "error" else "aborted"
        return PoolingRequestOutput(group.request_id, None, group.prompt_token_ids, True,
                                    req.num_cached_tokens, str(why))

    def abort_request(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests (by their user id); their blocks are freed at once. Returns each
        aborted request's last output, as vLLM's: finished, its unfinished sequences'
        finish_reason "abort", with the tokens (and text) they had (a stream's last delta)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs: list[RequestOutput] = []
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            live = [c for c in group.children if c.finish_reason is None]
            self._finish([c.request.request_id for c in live], RequestStatus.FINISHED_ABORTED)
            for c in live:
                c.finish_reason, c.stop_reason = "abort", None
                finish_text(group, c, self.tokenizer)
            for c in group.children:
                self._child_of.pop(c.request.request_id, None)
            self.stats["num_requests_aborted"] += 1
            out = self._group_output(group, True)
            if out is not None:
                outputs.append(out)
        return outputs

    def get_num_unfinished_requests(self) -> int:
        """Requests (user-level) not yet finished."""
        return len(self._groups)

    # ----------------------------------------------------------------- outputs
    def _outputs(self, updated: Sequence[Request], rows: Sequence[int], ids: Sequence[int],
                 lps: Sequence[float], result: Any) -> list[RequestOutput]:
        """RequestOutputs of the sequences a step updated (each got token ids[row]).

        `result`: what carries the step's top logprobs and ranks (`top_ids`, `top_logprobs`,
        `ranks` by row), read only for a sequence that asked for logprobs.
        """
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        done: list[Request] = []  # sequences finished by this step
        # One output per group and step, once all its updates are in (n > 1: every child's;
        # speculative decoding: a sequence may get several tokens, one update each).
        pending: dict[str, RequestGroup] = {}
        child_of, tokenizer, stop = self._child_of, self.tokenizer, self._stop_request
        emit = self._emit
        decode = None
        # Speculative decoding: a sequence updated k times this step got its last k tokens
        # (in process its request holds them all already): each update covers one more.
        left: dict[str, int] | None = None
        if len({r.request_id for r in updated}) != len(updated):
            left = {}
            for r in updated:
                left[r.request_id] = left.get(r.request_id, 0) + 1
        # Only the updated requests got a token: dropped ones get no logprobs either.
        for req, row in zip(updated, rows, strict=True):
            entry = child_of.get(req.request_id)
            if entry is None:
                continue
            group, child = entry
            if left is not None:
                n_left = left[req.request_id] = left[req.request_id] - 1
                child.seen = len(req.output_token_ids) - n_left
                if child.finish_reason is not None:
                    continue  # an earlier token of this step ended it (a stop string)
            elif child.seen >= 0:
                child.seen = -1
            if group.first_token_time is None:
                group.first_token_time = now
            if child.logprobs is not None:  # (vLLM: no cumulative_logprob without logprobs)
                if decode is None:
                    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
                record_logprobs(group, child, ids[row], lps[row], row, result, decode)
            finished = update_child(group, child, tokenizer, stop)
            if finished:
                done.append(req)
            pending[group.request_id] = group
        for group in pending.values():
            emit(group, outputs, group.finished)
        self.stat_logger.on_step(updated, now, done)
        return outputs

    def _emit(self, group: RequestGroup, outputs: list[RequestOutput], finished: bool) -> None:
        """Append the group's output of this step; forget the group once it is finished
        (`finished`: group.finished, which the caller has at hand)."""
        if group.params.prompt_logprobs is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = prompt_logprobs_of(group, functools.partial(
                self.tokenizer.decode, skip_special_tokens=False))
        ro = self._group_output(group, finished)
        if ro is not None:
            outputs.append(ro)
        if finished:
            del self._groups[group.request_id]
            for c in group.children:
                self._child_of.pop(c.request.request_id, None)
            self.stats["num_requests_finished"] += 1
            self._observe_finished(group)

    def _observe_finished(self, group: RequestGroup) -> None:
        """The stat logger's per-request figures of a finished request (not an aborted one,
        as vLLM)."""
        p = group.params
        self.stat_logger.on_request_finished(
            len(group.children), p.max_tokens, [num_output_tokens(c) for c in group.children])

    def _failed_outputs(self, failures: Sequence[tuple[str, str]]) -> list[RequestOutput]:
        """Final outputs of sequences the engine failed (finish_reason "error", the reason as
        stop_reason); their scheduler requests are already released."""
        outputs: list[RequestOutput] = []
        for rid, reason in failures:
            entry = self._child_of.get(rid)
            if entry is None:
                continue
            group, child = entry
            child.finish_reason = "error"
            child.stop_reason = reason
            self._emit(group, outputs, group.finished)
        return outputs

    def _stop_request(self, request_id: str) -> None:
        self._finish([request_id], RequestStatus.FINISHED_STOPPED)

    def _user_request_ids(self, state: dict[str, Any]) -> dict[str, Any]:
        """A cache_state snapshot with each sequence's user request id filled in."""
        for rid, entry in state["requests"].items():
            owner = self._child_of.get(rid)
            entry["user_request_id"] = owner[0].request_id if owner is not None else rid
        return state
