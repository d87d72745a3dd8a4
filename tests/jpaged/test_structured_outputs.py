"""Structured outputs end to end on the embedded SmolLM2: twenty JSON schemas sampled at
temperature 0.7 (two samples each) all validate, offline and through the OpenAI client's
response_format on a real server; regexes and choices always match; a forced tool call's
arguments validate; unconstrained rows in the same batch are untouched; constrained steps add
no compile once their shapes are warm; the overlapped and the synchronous loop agree."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from helpers import make_llm, tiny

from jpaged.async_engine import AsyncLLMEngine
from jpaged.bench.schemas import SCHEMAS
from jpaged.core.structured_output import consume
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jpaged.server import BackgroundServer, build_app

# The embedded model's steps running are this module's time, not its compiles.
pytestmark = pytest.mark.usefixtures("optimized_compiles")
ARGS = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def llm():
    return make_llm(**ARGS)


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True)


def _schema_prompt(tok, name: str) -> str:
    return _chat(tok, f"Write a JSON object for a {name}. Schema: {json.dumps(SCHEMAS[name])}")


def test_twenty_schemas_regexes_and_choices_all_valid_beside_an_untouched_greedy_row(llm):
    """A sample of each schema at temperature 0.7, eight of a date regex and eight of a choice
    at temperature 1.0 (n=8: one grammar per sequence), and a greedy unconstrained row, all in
    the same batches: every JSON sample validates and stops, every regex and choice sample
    matches, and the greedy row gives the tokens it gives alone. (One batch: the twenty
    schemas' longest answers set its steps, and the regex and choice rows ride in the same
    decode bucket. scripts/bench_structured.py validates 96 more per run.)"""
    tok = llm.get_tokenizer()
    free = _chat(tok, "Name three colors.")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([free], greedy, use_tqdm=False)[0].outputs[0].token_ids
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    choices = ["positive", "negative", "neutral"]
    prompts = ([_schema_prompt(tok, n) for n in SCHEMAS]
               + [_chat(tok, "What is today's date?"), _chat(tok, "Is this review good? 'Meh.'"),
                  free])
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]))
              for i, n in enumerate(SCHEMAS)] + [
        SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex=date)),
        SamplingParams(n=8, temperature=1.0, seed=4, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(choice=choices)),
        greedy]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(SCHEMAS) + 3
    bad = []
    for name, out in zip(SCHEMAS, outs, strict=False):
        assert len(out.outputs) == 1
        for c in out.outputs:
            try:
                jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as e:
                bad.append((name, c.finish_reason, c.text, str(e)[:200]))
            assert c.finish_reason == "stop", (name, c.text)
    assert not bad, bad
    dates, picks = outs[len(SCHEMAS)], outs[len(SCHEMAS) + 1]
    assert len(dates.outputs) == len(picks.outputs) == 8
    assert all(re.fullmatch(date, c.text) for c in dates.outputs), [c.text for c in dates.outputs]
    assert all(c.text in choices for c in picks.outputs), [c.text for c in picks.outputs]
    assert outs[-1].outputs[0].token_ids == alone  # the unconstrained row saw no mask


WARM_TOKENS = 6  # fewer than any of these schemas' shortest answer: every row runs to length


def test_warm_constrained_steps_compile_nothing_and_loops_agree(llm):
    """Two batches of the same shapes (one prompt, WARM_TOKENS tokens each: no schema's answer
    is shorter) with different grammars: the second compiles nothing. The overlapped loop
    (whose constrained steps run their forward before the masks are filled, and sample after)
    gives the seeded samples the synchronous loop gives."""
    names = ["order", "book", "config", "product", "weather", "event", "address", "tree"]
    texts = {}
    tok = llm.get_tokenizer()
    runner = llm.llm_engine.runner
    prompt = _chat(tok, "Write a JSON object.")
    for async_scheduling in (True, False):
        llm.llm_engine.set_async_scheduling(async_scheduling)
        deferred = runner.num_deferred

        def run(batch, llm=llm, prompt=prompt):
            params = [SamplingParams(temperature=0.8, seed=7, max_tokens=WARM_TOKENS,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]))
                      for n in batch]
            outs = llm.generate([prompt] * len(batch), params, use_tqdm=False)
            assert all(o.outputs[0].finish_reason == "length" for o in outs)
            return [o.outputs[0].text for o in outs]

        first = run(names[:4])
        compiled = runner.num_compiled
        second = run(names[4:8])
        if async_scheduling:
            assert runner.num_compiled == compiled, "a new grammar compiled a new step"
            # Overlapped: each constrained step's forward ran before its masks were filled
            # (every decode step of both batches: all but each batch's prompt step).
            assert runner.num_deferred - deferred >= 2 * (WARM_TOKENS - 1)
        else:
            assert runner.num_deferred == deferred
        texts[async_scheduling] = first + second
    llm.llm_engine.set_async_scheduling(True)
    assert texts[True] == texts[False]


def test_bad_grammar_is_refused_and_the_engine_goes_on(llm):
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="([a-z")), use_tqdm=False)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0,
                                                                    max_tokens=4),
                       use_tqdm=False)
    assert out[0].outputs[0].text
    # allowed_token_ids that leave the grammar no token: the request is aborted with the
    # reason, not continued unconstrained; the request beside it is untouched.
    paris = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)
    both = SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=paris,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=0.0, max_tokens=4)
    bad, ok = llm.generate(["Answer:", "The capital of France is"], [both, free],
                           use_tqdm=False)
    c = bad.outputs[0]
    assert c.finish_reason == "abort" and "structured output" in c.stop_reason, c
    assert len(c.token_ids) == 1
    assert ok.outputs[0].token_ids == out[0].outputs[0].token_ids
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


def test_openai_client_response_format_and_tool_call(llm):
    """Through a real server and the openai client: six response_format schemas validate, a
    named tool choice calls that tool with valid arguments, and tool_choice="required" ends in
    valid tool calls. The eight requests go at once (they share the engine's batches, so the
    run takes the steps of its longest answer, not the sum of three rounds); each is seeded."""
    engine = AsyncLLMEngine(llm.llm_engine)  # the module's last test: the engine is its own now
    server = BackgroundServer(build_app(engine, "smollm2"))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=300)
        weather = {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather of a city",
            "parameters": weather}}]

        def schema(name: str):
            return client.chat.completions.create(
                model="smollm2", temperature=0.7, seed=11, max_tokens=200,
                messages=[{"role": "user", "content": f"A JSON object for a {name}."}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": name, "schema": SCHEMAS[name], "strict": True}})

        def named():
            return client.chat.completions.create(
                model="smollm2", temperature=0.7, seed=11, max_tokens=100, tools=tools,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})

        def required():
            return client.chat.completions.create(
                model="smollm2", temperature=0.7, seed=11, max_tokens=150, tools=tools,
                tool_choice="required",
                messages=[{"role": "user", "content": "Weather in Rome?"}])

        # Six schemas (every schema is validated offline above) and the two tool calls.
        names = list(SCHEMAS)[::3][:6]
        with ThreadPoolExecutor(len(names) + 2) as pool:
            schema_calls = [pool.submit(schema, name) for name in names]
            named_call, required_call = pool.submit(named), pool.submit(required)
            for name, r in zip(names, schema_calls, strict=True):
                jsonschema.validate(json.loads(r.result().choices[0].message.content),
                                    SCHEMAS[name])
            call = named_call.result().choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), weather)
            r = required_call.result()
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), weather)
    finally:
        server.stop()
        engine.shutdown()


def test_offline_llm_closes_objects_by_default_and_takes_the_guidance_backend_option():
    """The offline LLM builds its grammars where the server does: by default (vLLM's default
    backend) an object schema without additionalProperties takes only its listed keys;
    LLM(structured_outputs_config={"backend": "guidance"}) keeps such objects open, as vLLM's
    guidance backend (tiny model: every sample would wander into other keys if it could)."""
    schema = {"type": "object", "properties": {"result": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}},
              "required": ["result"]}
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(json=schema))
    args = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    strict = make_llm(tiny(), **args)
    for c in strict.generate(["x"], sp, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop" and set(json.loads(c.text)) <= {"result"}, c.text
    lenient = make_llm(tiny(), structured_outputs_config={"backend": "guidance"}, **args)
    gc = lenient.llm_engine.grammar_compiler
    assert gc.config.open_objects and not strict.llm_engine.grammar_compiler.config.open_objects
    m = gc.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for ch in '{"result":1,"x':  # then a key the schema does not list
        assert consume(m, ord(ch)) is None
