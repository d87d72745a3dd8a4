"""LLMEngine: add_request / step / abort; ties the host scheduler to the device runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

from jpaged.config import EngineArgs, EngineConfig
from jpaged.core.scheduler import Scheduler
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jpaged.request import Request, RequestStatus
from jpaged.runner.batch import BucketPlan
from jpaged.runner.kv_cache import allocate_kv_cache, kv_dtype, num_blocks_for
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.sampler import NUM_TOP_LOGPROBS
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from models.loader import LoadedModel, load_model
from pallas_kernels.backend import select_backend

logger = logging.getLogger("jpaged")

PromptType = str | Mapping[str, Any]


@dataclass
class _Child:
    """Host-side output state of one sequence (a child of a request with n > 1)."""

    index: int
    request: Request
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    """A user request: its prompt, parameters and n children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def _param_bytes(params: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def _check_supported(config: EngineConfig) -> None:
    """Refuse settings this version cannot honour, with the field named."""
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size > 1 is not supported yet; use 1")
    if config.cache.preemption_mode == "swap" and config.cache.kv_offloading_size <= 0:
        raise ValueError("preemption_mode='swap' needs a host tier: set kv_offloading_size > 0")
    for name in ("kv_offloading_size", "swap_space"):
        if getattr(config.cache, name) > 0:
            raise ValueError(f"{name} > 0 needs the host/disk KV tiers, which this version "
                             "does not have yet; leave it at 0")
    if config.cache.preemption_mode == "swap" or config.cache.calculate_kv_scales:
        raise ValueError("preemption_mode='swap' and calculate_kv_scales are not supported "
                         "by this version yet")


class LLMEngine:
    """The engine behind `LLM` and the server: one jitted device step per `step()` call."""

    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None) -> None:
        args = args or EngineArgs()
        t0 = time.perf_counter()
        _check_supported(args.create_engine_config(model_max_len=2**31 - 1))  # before loading
        self.loaded = loaded or load_model(args.model, args.dtype)
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        config = args.create_engine_config(self.spec.max_position_embeddings)
        self.kv_dtype = kv_dtype(config.cache.kv_cache_dtype, self.loaded.model.dtype)
        params_bytes = _param_bytes(nnx.state(self.loaded.model))
        num_blocks = num_blocks_for(config.cache, self.spec, self.kv_dtype, params_bytes,
                                    config.scheduler.max_model_len)
        self.config: EngineConfig = config.with_num_blocks(num_blocks)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks)
        plan = BucketPlan(self.config.scheduler.max_num_seqs,
                          self.config.scheduler.max_num_batched_tokens,
                          self.config.scheduler.max_model_len, self.config.cache.block_size)
        kv = allocate_kv_cache(self.spec, num_blocks, self.config.cache.block_size, self.kv_dtype)
        self.ops = select_backend(self.config.model.attention_backend)
        self.runner = ModelRunner(self.loaded.model, kv, plan, self.config.cache.block_size,
                                  self.spec.vocab_size, self.ops, self.config.model.seed)
        self._groups: dict[str, _Group] = {}
        self._child_of: dict[str, tuple[str, int]] = {}
        self._counter = 0
        # Token and step counters live in the scheduler; these count user-level requests.
        self.stats = {"num_requests_finished": 0, "num_requests_aborted": 0}
        logger.info("engine ready in %.1fs: %s, %d KV blocks, backend %s",
                    time.perf_counter() - t0, self.loaded.source, num_blocks, self.ops.name)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Build an engine from EngineArgs (vLLM's spelling)."""
        return cls(args)

    # ----------------------------------------------------------------- requests
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        salt = None
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
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
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids contains {t!r}, outside the vocabulary "
                                 f"[0, {vocab})")
        max_len = self.config.scheduler.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_len}: "
                             "it must leave room for at least one generated token")
        return text, ids, salt

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Validate, tokenize and queue a request; n > 1 fans out into n sequences."""
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if params.logprobs is not None and params.logprobs > NUM_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs must be <= {NUM_TOP_LOGPROBS}, got "
                             f"{params.logprobs}")
        text, ids, salt = self._tokenize(prompt)
        eos = tuple(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos = eos + (self.tokenizer.eos_token_id,)
        max_len = self.config.scheduler.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        base = params.clone(eos_token_ids=eos, max_tokens=max_tokens)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        group = _Group(request_id, text, ids, base, arrival_time=arrival)
        for i in range(params.n):
            self._counter += 1
            seed = (params.seed + i) if params.seed is not None else (
                self.config.model.seed * 1_000_003 + self._counter)
            child_params = base.clone(n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, ids, child_params, priority=priority, arrival_time=arrival,
                          cache_salt=salt)
            group.children.append(_Child(i, req, logprobs=[] if params.logprobs is not None
                                         else None))
            self._child_of[child_id] = (request_id, i)
        self._groups[request_id] = group
        for c in group.children:
            self.scheduler.add_request(c.request)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (by their user id); their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            live = [c.request.request_id for c in group.children if c.finish_reason is None]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for c in group.children:
                self._child_of.pop(c.request.request_id, None)
            self.stats["num_requests_aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests (user-level) not yet finished."""
        return len(self._groups)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Schedule, run one device step, update, and return outputs of updated requests."""
        out = self.scheduler.schedule()
        sampled: dict[str, int] = {}
        result = None
        if out.scheduled:
            result = self.runner.execute(out.scheduled)
            for i, s in enumerate(out.scheduled):
                if s.sample:
                    sampled[s.request.request_id] = int(result.token_ids[i])
        updated = self.scheduler.update_from_output(out, sampled)
        if result is not None:
            self._record_logprobs(out, result)
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req in updated:
            key = self._child_of.get(req.request_id)
            if key is None:
                continue
            group = self._groups[key[0]]
            child = group.children[key[1]]
            if req.request_id in sampled and group.first_token_time is None:
                group.first_token_time = now
            self._update_child(group, child)
            touched[group.request_id] = None
        outputs = []
        for rid in touched:
            group = self._groups[rid]
            ro = self._make_output(group)
            if ro is not None:
                outputs.append(ro)
            if group.finished:
                del self._groups[rid]
                for c in group.children:
                    self._child_of.pop(c.request.request_id, None)
                self.stats["num_requests_finished"] += 1
        return outputs

    def _record_logprobs(self, out: Any, result: Any) -> None:
        for i, s in enumerate(out.scheduled):
            key = self._child_of.get(s.request.request_id)
            if not s.sample or key is None:
                continue
            group = self._groups[key[0]]
            child = group.children[key[1]]
            tok = int(result.token_ids[i])
            lp = float(result.logprobs[i])
            child.cumulative_logprob += lp
            if child.logprobs is None:
                continue
            entry = {tok: Logprob(lp, None, self.tokenizer.decode([tok], False))}
            for j in range(group.params.logprobs or 0):
                cand = int(result.top_ids[i, j])
                if cand == tok:
                    entry[tok].rank = j + 1
                entry.setdefault(cand, Logprob(float(result.top_logprobs[i, j]), j + 1,
                                               self.tokenizer.decode([cand], False)))
            child.logprobs.append(entry)

    def _update_child(self, group: _Group, child: _Child) -> None:
        req = child.request
        p = group.params
        needs_text = bool(p.stop) or req.is_finished() or (
            p.output_kind != RequestOutputKind.FINAL_ONLY)
        if needs_text:
            child.text = self.tokenizer.decode(req.output_token_ids,
                                               skip_special_tokens=p.skip_special_tokens)
        if p.stop and not req.is_finished():
            self._check_stop_strings(child, p)
        if req.is_finished() and child.finish_reason is None:
            child.finish_reason = req.finish_reason
            child.stop_reason = req.stop_reason
            if p.stop and child.stop_reason is None:
                self._check_stop_strings(child, p, finished=True)

    def _check_stop_strings(self, child: _Child, p: SamplingParams, finished: bool = False) -> None:
        # Only the tail can contain a stop string that was not there at the previous step.
        window = max(len(s) for s in p.stop) + 16
        start = max(0, child.sent_text_len - window) if not finished else 0
        best = None
        for s in p.stop:
            k = child.text.find(s, start)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, s)
        if best is None:
            return
        k, s = best
        child.text = child.text[: k + len(s)] if p.include_stop_str_in_output else child.text[:k]
        if not finished:
            self.scheduler.finish_requests([child.request.request_id],
                                           RequestStatus.FINISHED_STOPPED)
        child.finish_reason = "stop"
        child.stop_reason = s

    def _make_output(self, group: _Group) -> RequestOutput | None:
        kind = group.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not group.finished:
            return None
        outs = []
        for c in group.children:
            ids = list(c.request.output_token_ids)
            text = c.text
            lps = c.logprobs
            if kind == RequestOutputKind.DELTA:
                # Hold back a trailing partial UTF-8 character until it completes.
                safe = len(text) if c.finish_reason else len(text.rstrip("\ufffd"))
                text, c.sent_text_len = text[c.sent_text_len:safe], max(c.sent_text_len, safe)
                ids, c.sent_tokens = ids[c.sent_tokens:], len(ids)
                lps = lps[len(lps) - len(ids):] if lps is not None else None
            else:
                c.sent_text_len = len(text)
            outs.append(CompletionOutput(c.index, text, ids, c.cumulative_logprob,
                                         list(lps) if lps is not None else None,
                                         c.finish_reason, c.stop_reason))
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                             group.finished, metrics,
                             num_cached_tokens=getattr(group.children[0].request,
                                                       "num_cached_tokens", 0))

    # ----------------------------------------------------------------- metrics
    def get_metrics(self) -> dict[str, Any]:
        """Scheduler and cache gauges plus engine counters (vLLM's names)."""
        m = dict(self.scheduler.get_stats())
        m.update(self.stats)
        m["num_gpu_blocks"] = self.config.cache.num_gpu_blocks
        m["block_size"] = self.config.cache.block_size
        return m

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses; False if some are in use."""
        return self.scheduler.reset_prefix_cache()
