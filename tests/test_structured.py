"""Structured outputs (grammar.py, server/structured_fields.py): a constrained row's output matches its JSON schema,
regex, choice or Lark grammar, ends with "stop" when the spec is complete, and keeps every exactness claim: alone ==
in a batch of mixed rows, n samples == solo runs, preempted and replayed == alone, speculative == plain. Then the
official openai client against SmolLM2 (20 JSON schemas at temperature 0 and 0.8, validated with jsonschema), the
spellings OpenAI and vLLM use, 400s that name a bad spec, and `generate --json-schema / --regex`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest

from nanoinfer.engine import Engine
from nanoinfer.grammar import GrammarCompiler
from nanoinfer.sampling import SamplingParams, row_seed
from nanoinfer.speculative import DraftModelProposer, NgramProposer
from nanoinfer.structured import StructuredOutput
from nanoinfer.weights import load

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# what the tool-calling side sends: a Lark grammar with a JSON schema embedded by llguidance's %json
TOOL_CALL_GRAMMAR = ('start: "<call>" args "</call>"\n'
                     'args: %json{"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, '
                     '"required": ["city"], "additionalProperties": false}')
CHOICES = ("yes", "no", "maybe")
REGEX = r"[0-9]{2,4}-[a-z]{1,6}"


def specs() -> dict[str, StructuredOutput]:
    return {"json_schema": StructuredOutput("json_schema", json.dumps(PERSON)),
            "json_object": StructuredOutput("json_object"),
            "regex": StructuredOutput("regex", REGEX),
            "choice": StructuredOutput("choice", CHOICES),
            "grammar": StructuredOutput("grammar", TOOL_CALL_GRAMMAR)}


def matches(structured: StructuredOutput, text: str) -> bool:
    """Whether a finished ("stop") output is what its spec asks for."""
    if structured.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(structured.spec))
        return True
    if structured.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if structured.kind == "regex":
        return re.fullmatch(structured.spec, text) is not None
    if structured.kind == "choice":
        return text in structured.spec
    body = re.fullmatch(r"<call>(.*)</call>", text, re.DOTALL)
    return body is not None and set(json.loads(body[1])) == {"city"}


def rows_of(completions) -> list[tuple]:
    return [(c.token_ids, c.logprobs, c.top_logprobs, c.text, c.finish_reason) for c in completions]


def run_together(engine: Engine, work: list[tuple[list[int], SamplingParams, int]]) -> list[list[tuple]]:
    """All requests submitted at once; each request's rows (tokens, logprobs, top logprobs, text, finish)."""
    requests = [engine.add_request(prompt, params, n) for prompt, params, n in work]
    while engine.has_work:
        engine.step()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    return [rows_of(r.rows[i].completion for i in range(len(r.rows))) for r in requests]


@pytest.fixture(scope="module")
def calc_prompts(calc):
    _, tokenizer = calc
    return [tokenizer.render_chat([{"role": "user", "content": text}])
            for text in ("Give me JSON", "What is 12 times 34?", "Say yes or no", "Call a tool")]


# ---- the matcher ----------------------------------------------------------------------------------------------
def test_inside_a_json_string_no_control_token_is_allowed(smollm2_tokenizer):
    """Control tokens are chat markup: a grammar's text never becomes one (only the end ids, where it may end)."""
    grammar = GrammarCompiler(smollm2_tokenizer, 49152).row_grammar(StructuredOutput("json_object"))
    for token in smollm2_tokenizer.encode('{"note": "A'):
        grammar.consume(token)
    allowed = grammar.allowed()
    assert allowed.sum() > 1000, "any text may go on inside a string"
    assert not any(allowed[token] for token in smollm2_tokenizer.control_ids)


def test_each_kind_of_spec_accepts_its_text_and_then_only_ends(smollm2_tokenizer):
    compiler = GrammarCompiler(smollm2_tokenizer, 49152)
    texts = {"json_schema": '{"name": "Ann", "age": 30}', "json_object": '{"a": [1, 2]}', "regex": "123-ab",
             "choice": "maybe", "grammar": '<call>{"city": "Oslo"}</call>'}
    for kind, structured in specs().items():
        grammar = compiler.row_grammar(structured)
        for token in smollm2_tokenizer.encode(texts[kind]):
            assert grammar.allowed()[token], f"{kind}: {texts[kind]!r} refused"
            grammar.consume(token)
        allowed = grammar.allowed()
        if kind == "regex":        # [a-z]{1,6} may go on: letters and the end are allowed, nothing else
            assert allowed[smollm2_tokenizer.encode("c")[0]] and not allowed[smollm2_tokenizer.encode("-")[0]]
        else:                      # complete: the spec takes nothing more
            assert grammar.finished and allowed.nonzero().flatten().tolist() == sorted(smollm2_tokenizer.end_ids)


@pytest.mark.parametrize("structured, problem", [
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("json_schema", '{"type": "fish"}'), "Invalid type: fish"),
    (StructuredOutput("grammar", "start: undefined_rule"), "unknown name"),
])
def test_a_spec_that_does_not_compile_is_refused_when_the_request_is_made(calc, structured, problem):
    with pytest.raises(ValueError, match=f"the {structured.kind} constraint does not compile: .*{problem}"):
        Engine(*calc).new_request([1, 2, 3], SamplingParams(structured=structured))


# ---- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.exactness
def test_constrained_rows_alone_equal_the_same_rows_in_a_batch_of_8_mixed_rows(calc, calc_prompts, threads):
    """5 constrained rows (every kind; one request of n=2), 3 free ones: each request's rows are bitwise what it
    gets alone, and row 1 of the n=2 request is the solo request with its row seed."""
    kinds = specs()
    work = [(calc_prompts[0], SamplingParams(temperature=0.8, seed=1, max_tokens=14, logprobs=2,
                                             structured=kinds["json_schema"]), 2),
            (calc_prompts[1], SamplingParams(temperature=0, max_tokens=14, logprobs=2,
                                             structured=kinds["regex"]), 1),
            (calc_prompts[2], SamplingParams(temperature=0.9, seed=3, max_tokens=14, logprobs=2,
                                             structured=kinds["choice"]), 1),
            (calc_prompts[3], SamplingParams(temperature=0.7, seed=4, top_k=20, max_tokens=14, logprobs=2,
                                             repetition_penalty=1.3, structured=kinds["grammar"]), 1),
            (calc_prompts[1], SamplingParams(temperature=0.8, seed=5, max_tokens=14, logprobs=2), 1),
            (calc_prompts[0], SamplingParams(temperature=0, max_tokens=14, logprobs=2), 1),
            (calc_prompts[2], SamplingParams(temperature=1.0, seed=6, max_tokens=14, logprobs=2), 1)]
    assert sum(n for _, _, n in work) == 8
    together = run_together(Engine(*calc), work)
    alone = [run_together(Engine(*calc), [item])[0] for item in work]
    assert together == alone
    prompt, params, _ = work[0]
    solo_row_1 = run_together(Engine(*calc), [(prompt, replace(params, seed=row_seed(1, 1)), 1)])[0]
    assert together[0][1] == solo_row_1[0]
    for (_, params, _), rows in zip(work, together):
        for _, _, _, text, finish in rows:
            if params.structured is not None and finish == "stop":
                assert matches(params.structured, text), (params.structured.kind, text)
    assert together[2][0][4] == "stop" and together[2][0][3] in CHOICES, "a choice must end the row with 'stop'"


@pytest.mark.exactness
def test_preempted_constrained_rows_replay_to_the_bits_they_get_alone(calc, calc_prompts):
    """A KV budget too small for the batch's growth: the newest request is preempted and replayed; its rows'
    matchers keep the state of the outputs they had, and every row equals its request served alone."""
    long_regex = StructuredOutput("regex", "[a-z]( [a-z]){59,70}")     # a token holds at most one letter
    work = [(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=90, logprobs=1, structured=long_regex), 2)
            for i, prompt in enumerate(calc_prompts)]
    engine = Engine(*calc, kv_memory_bytes=3 * 2**20)             # 768 slots: 8 rows of 110 tokens do not fit
    together = run_together(engine, work)
    assert engine.scheduler.preemptions > 0, "the budget was meant to preempt a request"
    alone = [run_together(Engine(*calc), [item])[0] for item in work]
    assert together == alone
    assert all(re.fullmatch(long_regex.spec, text) for rows in together for *_, text, finish in rows
               if finish == "stop")


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_constrained_speculative_decoding_equals_constrained_plain_decoding(calc, calc_prompts, kind,
                                                                                   threads):
    model, tokenizer = calc
    kinds = specs()
    work = [(prompt, SamplingParams(temperature=0, max_tokens=24, logprobs=2, structured=kinds[name]), 1)
            for prompt, name in zip(calc_prompts, ("json_object", "regex", "json_schema", "grammar"))]
    plain = run_together(Engine(model, tokenizer), work)
    speculator = NgramProposer() if kind == "ngram" else DraftModelProposer(load("calc-nanochat", quant="q8_0")[0])
    engine = Engine(model, tokenizer, speculator=speculator, num_spec=4)
    assert run_together(engine, work) == plain
    assert engine.accepted_tokens > 0, "no guess was kept: the test proves nothing"


def test_sampled_constrained_speculation_stays_inside_the_grammar(calc, calc_prompts):
    model, tokenizer = calc
    structured = specs()["json_schema"]
    engine = Engine(model, tokenizer, speculator=DraftModelProposer(load("calc-nanochat", quant="q8_0")[0]),
                    num_spec=4)
    work = [(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=40, structured=structured), 2)
            for i, prompt in enumerate(calc_prompts)]
    rows = [row for request in run_together(engine, work) for row in request]
    finished = [text for *_, text, finish in rows if finish == "stop"]
    assert finished and all(matches(structured, text) for text in finished)
    assert engine.accepted_tokens > 0


# ---- the official client on SmolLM2 ---------------------------------------------------------------------------
def small_schemas() -> list[dict]:
    """20 small schemas: nested objects, enums, arrays, bounded numbers, required fields. Strings and arrays have
    a bound and fractions a multipleOf (exact in binary, as jsonschema checks it in floats), or a sampled answer
    could run past max_tokens (SmolLM2 wrote 49.7896001574623306 at 0.8)."""
    word = {"type": "string", "maxLength": 10}

    def obj(properties: dict, required: list[str] | None = None) -> dict:
        return {"type": "object", "properties": properties, "required": list(required or properties),
                "additionalProperties": False}

    return [
        obj({"name": word, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        obj({"color": {"enum": ["red", "green", "blue"]}}),
        obj({"ok": {"type": "boolean"}}),
        obj({"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}),
        obj({"tags": {"type": "array", "items": word, "minItems": 1, "maxItems": 3}}),
        obj({"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                           "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
        obj({"city": word, "country": word}),
        obj({"level": {"enum": ["low", "mid", "high"]}, "count": {"type": "integer", "minimum": 1, "maximum": 5}}),
        obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}})}),
        obj({"answer": {"enum": ["yes", "no"]}}),
        obj({"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                        "minItems": 2, "maxItems": 4}}),
        obj({"title": word, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
        obj({"temperature": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25},
             "unit": {"enum": ["C", "F"]}}),
        obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
        obj({"first": word, "last": word}, required=["first"]),
        obj({"items": {"type": "array", "items": obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}}),
                       "minItems": 1, "maxItems": 2}}),
        obj({"status": {"enum": ["open", "closed"]}, "priority": {"type": "integer", "minimum": 1, "maximum": 3}}),
        obj({"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.25},
             "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.25}}),
        obj({"pet": {"enum": ["cat", "dog"]}, "name": word, "age": {"type": "integer", "minimum": 0, "maximum": 30}}),
        obj({"done": {"type": "boolean"}, "note": word}),
    ]


@pytest.fixture(scope="module")
def smollm2_server(smollm2):
    from nanoinfer.server.app import create_app
    from nanoinfer.server.running import BackgroundServer

    running = BackgroundServer(create_app(Engine(*smollm2), "smollm2"))
    yield running
    running.stop()


def test_openai_client_json_schema_output_validates_for_20_schemas_at_two_temperatures(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", timeout=900)
    asks = [(i, schema, temperature) for i, schema in enumerate(small_schemas()) for temperature in (0, 0.8)]

    def ask(item):
        i, schema, temperature = item
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Reply with a JSON object."}],
            temperature=temperature, seed=i, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})

    with ThreadPoolExecutor(len(asks)) as pool:          # all at once: the server batches them
        answers = list(pool.map(ask, asks))
    for (i, schema, temperature), answer in zip(asks, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (i, temperature, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_take_vllm_and_openai_spellings_of_every_constraint(smollm2_server):
    url = f"{smollm2_server.url}/v1/completions"
    prompt = {"prompt": "A person as JSON, with a name and an age:", "max_tokens": 32, "temperature": 0}
    bodies = {
        "regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        "choice": ({"structured_outputs": {"choice": list(CHOICES)}}, lambda t: t in CHOICES),
        "grammar": ({"structured_outputs": {"grammar": TOOL_CALL_GRAMMAR}},
                    lambda t: matches(specs()["grammar"], t)),
        "json": ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)
                 is None),
        "guided_json": ({"guided_json": json.dumps(PERSON)}, lambda t: "name" in json.loads(t)),
        "guided_choice": ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        "guided_regex": ({"guided_regex": "[A-Z]{3}"}, lambda t: re.fullmatch("[A-Z]{3}", t)),
        "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    }
    for name, (fields, check) in bodies.items():
        response = httpx.post(url, json={**prompt, **fields}, timeout=600)
        assert response.status_code == 200, (name, response.text)
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (name, choice)


@pytest.mark.parametrize("fields, param, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fish"}}}},
     "response_format.json_schema.schema", "Invalid type: fish"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_json": "{not json"}, "guided_json", "Expecting property name"),
    ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "guided_regex", "ask for one structured"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a 'json_schema'"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "at most 65536 characters"),
])
def test_a_bad_constraint_is_a_400_that_names_the_field(server, fields, param, problem):
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        response = httpx.post(f"{server.url}{path}", json={**base, **fields, "max_tokens": 4}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and problem in error["message"], error


# ---- the command line -----------------------------------------------------------------------------------------
def generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoinfer.cli", "generate", "--model", "calc-nanochat",
                           "--max-tokens", "30", "--json", *flags, "What is 2+2?"],
                          check=False, capture_output=True, text=True, timeout=300)


def test_generate_json_schema_and_regex_flags_constrain_the_output(tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    for flags, check in ((("--json-schema", str(schema_file)), lambda t: matches(specs()["json_schema"], t)),
                         (("--regex", REGEX), lambda t: re.fullmatch(REGEX, t))):
        done = generate(*flags, "--temperature", "0.8", "--seed", "2")
        assert done.returncode == 0, done.stderr
        [sample] = json.loads(done.stdout)["samples"]
        assert sample["finish_reason"] != "stop" or check(sample["text"]), sample


@pytest.mark.parametrize("flags, problem", [
    (("--regex", "a(b"), "--regex: the regex constraint does not compile"),
    (("--json-schema", "/nonexistent/schema.json"), "--json-schema: cannot read"),
    (("--json-schema", "/dev/null"), "--json-schema: /dev/null is not JSON"),
    (("--regex", "a", "--json-schema", "x.json"), "--json-schema and --regex cannot be used together"),
])
def test_generate_refuses_a_bad_constraint_with_exit_2_and_one_line(flags, problem):
    done = generate(*flags)
    assert done.returncode == 2
    assert problem in done.stderr and done.stderr.count("\n") == 1, done.stderr
