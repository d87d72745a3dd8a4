"""Beam search's bookkeeping, as vLLM's `LLM.beam_search` does it: each prompt keeps up to
`beam_width` live beams; a step runs every live beam as a one-token request asking for its
2 x beam_width most likely next tokens, extends each beam by each of them, and keeps the
`beam_width` best by the length-penalized score. A front end drives it (`BeamSearch.requests`,
run them, `BeamSearch.advance`); nothing here runs a model."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from jpaged.outputs import Logprob, RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchSequence", "get_beam_search_score"]


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones, each generated token's candidates
    (their logprobs), and the sum of the chosen tokens' logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0  # jpaged: tokens[num_prompt_tokens:] are the generated ones

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (the EOS that ended a "stop" beam included)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The `beam_width` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: int | Collection[int] | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (and HF's) beam score: the cumulative logprob over the sequence's length raised to
    `length_penalty`, a final EOS not counted; the length includes the prompt, as in vLLM."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    length = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (max(length, 1) ** length_penalty)


class _Instance:
    """One prompt's live beams and its finished ones."""

    def __init__(self) -> None:
        self.beams: list[BeamSearchSequence] = []
        self.completed: list[BeamSearchSequence] = []


class BeamSearch:
    """Beam search over `num_prompts` prompts. Step 0's requests are the prompts themselves (the
    engine tokenizes them: `advance` reads their tokens off the outputs); later requests are the
    live beams as token prompts. Done when no beam is live or `max_tokens` steps have run."""

    def __init__(self, num_prompts: int, params: BeamSearchParams,
                 eos_token_ids: Collection[int], max_model_len: int,
                 logprobs_limit: int | None = None) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if logprobs_limit is not None and 2 * params.beam_width > logprobs_limit:
            raise ValueError(f"beam_width {params.beam_width} asks for {2 * params.beam_width} "
                             f"candidates a step, more than the engine's max_logprobs "
                             f"({logprobs_limit}) allows: beam_width <= {logprobs_limit // 2}, "
                             "or a larger --max-logprobs")
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.instances = [_Instance() for _ in range(num_prompts)]
        self.steps = 0
        # Each beam's next token: its 2 x beam_width best candidates (HF's and vLLM's rule: a
        # beam_width of them may end in EOS and still leave beam_width to go on).
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature, ignore_eos=True)

    @property
    def done(self) -> bool:
        """Whether every prompt's search has ended."""
        if self.steps == 0:
            return not self.instances
        return self.steps >= self.params.max_tokens or not any(i.beams for i in self.instances)

    def requests(self) -> list[dict[str, list[int]]] | None:
        """The live beams of every prompt, in order, as token prompts (None at step 0: run the
        prompts as given)."""
        if self.steps == 0:
            return None
        return [{"prompt_token_ids": list(b.tokens)} for i in self.instances for b in i.beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Extend the beams by the step's outputs (one per request, in `requests` order)."""
        # Step 0 runs each prompt once; later steps each live beam.
        expected = (len(self.instances) if self.steps == 0
                    else sum(len(i.beams) for i in self.instances))
        if len(outputs) != expected:
            raise ValueError(f"beam search step {self.steps}: {len(outputs)} outputs for "
                             f"{expected} beams")
        if self.steps == 0:  # each prompt's one beam: its tokens as the engine read them
            for inst, o in zip(self.instances, outputs, strict=True):
                inst.beams = [BeamSearchSequence(tokens=list(o.prompt_token_ids),
                                                 num_prompt_tokens=len(o.prompt_token_ids))]
        start = 0
        for inst in self.instances:
            grown: list[BeamSearchSequence] = []
            n = len(inst.beams)
            for beam, out in zip(inst.beams, outputs[start:start + n], strict=True):
                cands = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else {}
                for token, lp in cands.items():
                    new = BeamSearchSequence(
                        tokens=beam.tokens + [token], logprobs=beam.logprobs + [cands],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                        num_prompt_tokens=beam.num_prompt_tokens)
                    if token in self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        inst.completed.append(new)
                    else:
                        grown.append(new)
            start += n
            grown.sort(key=self._score, reverse=True)
            inst.beams = grown[:self.params.beam_width]
            # A beam at the model's length cannot take another token: it ends here.
            for b in [b for b in inst.beams if len(b.tokens) >= self.max_model_len]:
                b.finish_reason = "length"
                inst.completed.append(b)
            inst.beams = [b for b in inst.beams if b.finish_reason is None]
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best sequences, finished or not (those end by length)."""
        outs = []
        for inst in self.instances:
            for b in inst.beams:
                b.finish_reason = "length"
            best = sorted(inst.completed + inst.beams, key=self._score, reverse=True)
            outs.append(BeamSearchOutput(best[:self.params.beam_width]))
        return outs

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos,
                                     self.params.length_penalty)
