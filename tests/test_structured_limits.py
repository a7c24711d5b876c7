"""A constraint llguidance cannot keep is never claimed kept (grammar.py): a spec that does not compile or runs
out of llguidance's budget on its first masks is a one-line 400 when the request arrives, every time (never
cached); a row whose matcher errs partway fails its request alone with a clean error; and across a sweep of
pathological regexes, schemas and grammars, sent again and again, every 200 whose choice says "stop" matches its
constraint."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import llguidance
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from nanoinfer.engine import Engine
from nanoinfer.grammar import LIMITS, ConstraintBroken, GrammarCompiler, RowGrammar, grammar_text
from nanoinfer.sampling import SamplingParams
from nanoinfer.structured import StructuredOutput

# a counted repetition whose first mask spends the shared lexer's whole budget (the next copy is in error)
HUGE_REPETITIONS = ("a{1000000}", "b{400000}", "a{300000}")


def regex_check(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def schema_check(schema: dict):
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True
    return check


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}
    return schema


# (structured_outputs field, its value, whether a "stop" text keeps it)
PATHOLOGICAL = [
    *(("regex", rx, regex_check(rx)) for rx in HUGE_REPETITIONS),
    ("regex", "(a{1000}){1000}", regex_check("(a{1000}){1000}")),
    ("regex", "[0-9]{300000}", regex_check("[0-9]{300000}")),
    ("regex", "(a|aa)*b", regex_check("(a|aa)*b")),
    ("regex", "(x+x+)+y", regex_check("(x+x+)+y")),
    ("regex", ".{0,200000}", regex_check(".{0,200000}")),
    ("regex", "(1|2|12)*3{2}", regex_check("(1|2|12)*3{2}")),
    ("json", {"type": "string", "maxLength": 1000000}, schema_check({"type": "string", "maxLength": 1000000})),
    ("json", {"type": "string", "pattern": "^a{300000}$"}, schema_check({"type": "string", "pattern": "^a{300000}$"})),
    ("json", {"type": "array", "items": {"type": "integer"}, "minItems": 100000},
     schema_check({"type": "array", "items": {"type": "integer"}, "minItems": 100000})),
    ("json", {"type": "integer", "minimum": -1e300, "maximum": 1e300},
     schema_check({"type": "integer", "minimum": -1e300, "maximum": 1e300})),
    ("json", nested(60), schema_check(nested(60))),
    ("grammar", 'start: "a"{300000}', regex_check("a{300000}")),
    ("grammar", "start: /a{1000000}/", regex_check("a{1000000}")),
    ("grammar", 'start: start start | "1"', regex_check("1+")),
    ("grammar", "start: " + '("a" ' * 2000 + ")" * 2000, regex_check("a{2000}")),
]


def test_a_spec_that_runs_out_of_the_lexer_budget_is_refused_at_compile_and_never_cached(calc):
    model, tokenizer = calc
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    for pattern in HUGE_REPETITIONS:
        structured = StructuredOutput("regex", pattern)
        for _ in range(2):                       # the second time is refused as the first was: nothing cached
            with pytest.raises(ValueError, match="the regex constraint is too complex to enforce: lexer error: "
                                                 "too many expressions constructed$"):
                compiler.compile(structured)
        assert structured not in compiler._compiled


def test_an_errored_matcher_is_never_read_as_a_finished_spec(calc):
    """What the cache used to hand out: a copy of `a{1000000}`'s matcher after one row spent the lexer's budget.
    It reads as stopped (and its mask allows only the end ids); the row raises instead of ending with "stop"."""
    model, tokenizer = calc
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    structured = StructuredOutput("regex", "a{1000000}")
    compiled = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar_text(structured), log_level=0, limits=LIMITS)
    RowGrammar(compiled.deep_copy(), model.config.vocab_size, "regex").allowed()       # spends the budget
    matcher = compiled.deep_copy()
    mask = allocate_token_bitmask(1, model.config.vocab_size)
    fill_next_token_bitmask(matcher, mask, 0)                   # the next row's first mask: the end ids alone
    assert matcher.is_error() and matcher.is_stopped()
    broken = RowGrammar(matcher, model.config.vocab_size, "regex")
    for use in (lambda: broken.finished, broken.allowed, lambda: broken.consume(0)):
        with pytest.raises(ConstraintBroken, match=r"^the regex constraint could not be kept after 0 tokens: "
                                                   r"lexer error: too many expressions constructed$"):
            use()


def test_a_row_whose_matcher_breaks_partway_fails_its_request_alone_and_the_spec_is_compiled_again(calc):
    """A spec that passed its probe and broke later (here: put in the cache without one): the request fails
    with the matcher's reason, a free request beside it finishes, and the spec leaves the cache."""
    model, tokenizer = calc
    engine = Engine(model, tokenizer)
    structured = StructuredOutput("regex", "a{1000000}")
    compiled = llguidance.LLMatcher(engine.grammars._llg_tokenizer(), grammar_text(structured), log_level=0,
                                    limits=LIMITS)
    engine.grammars._compiled[structured] = compiled
    prompt = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    constrained = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, structured=structured), n=2)
    free = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6))
    while engine.has_work:
        engine.step()
    assert constrained.error is not None and "too many expressions constructed" in str(constrained.error)
    assert "\n" not in str(constrained.error)
    assert [row.completion.finish_reason for row in constrained.rows] == ["error", "error"]
    assert free.error is None and free.rows[0].completion.finish_reason == "length"
    assert structured not in engine.grammars._compiled
    with pytest.raises(ValueError, match="too complex to enforce"):          # compiled afresh: refused at once
        engine.new_request(prompt, SamplingParams(structured=structured))


def test_no_200_claims_a_pathological_constraint_it_did_not_keep(server):
    """Each spec twice (the first request used to break the cached matcher for every later one), n=2,
    sampled: a 400 is one line naming the field; a 200's "stop" choices match the spec."""
    outcomes = []
    for field, spec, keeps in PATHOLOGICAL:
        for attempt in range(2):
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "prompt": "12+3=", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": attempt,
                "structured_outputs": {field: spec}})
            assert response.status_code in (200, 400), (field, spec, response.text)
            if response.status_code == 400:
                error = response.json()["error"]
                assert error["param"] == f"structured_outputs.{field}" or "constraint" in error["message"], error
                assert "\n" not in error["message"] and "<state>" not in error["message"], error
                outcomes.append(400)
                continue
            for choice in response.json()["choices"]:
                assert choice["finish_reason"] in ("stop", "length"), (spec, choice)
                if choice["finish_reason"] == "stop":
                    assert keeps(choice["text"]), (field, spec, choice)
            outcomes.append(200)
        assert len(set(outcomes[-2:])) == 1, (field, spec, outcomes[-2:])      # the same answer every time
    assert outcomes.count(400) >= 2 * len(HUGE_REPETITIONS) and outcomes.count(200) > 0
