"""The matcher that holds a constrained row to its `StructuredOutput`: llguidance grammars compiled once per spec,
one matcher per row, and the mask of the tokens the row may pick next.

    compiler = GrammarCompiler(tokenizer, vocab_size)     # one per engine; builds llguidance's tokenizer once
    grammar = compiler.row_grammar(StructuredOutput("json_schema", schema))   # ValueError names a bad spec
    grammar.allowed()          # bool (V,): the tokens that keep the output a prefix of something the spec matches
    grammar.consume(token)     # after the row picked it; `finished` once the spec can take nothing more

A row's matcher has consumed exactly the row's output tokens: `RowState.advance` feeds it each token the
row emits, and nothing else does, so a preempted row that replays its output keeps the matcher it had, and a
speculative step's rejected guesses never reach it. A draft model's guesses get their masks by consuming the
guesses and rolling them back (`allowed(guesses)`); an n-gram guess is trimmed to the part the grammar accepts
(`valid_prefix`) before it costs a forward.

The end ids are llguidance's EOS: a spec that is complete allows them, and a spec that can take nothing more
ends the row at once (finish reason "stop"). A spec's texts (schema, regex, Lark) are compiled with llguidance's
default limits, so a grammar's size and its lexer's work per token are bounded.

A matcher that hits a limit enters an error state for good, and its copies share the compiled matcher's lexer
(and its budget of regex expressions: `a{300000}` spends it on its first row's first mask, and every later
copy is in error at once). So a spec is refused when compiled unless a row's first two steps and the next
row's first mask come out clean (`compile`), and a row whose matcher errs later raises `ConstraintBroken` (its request fails; the spec leaves
the cache, so the next request compiles it afresh). An errored matcher reads as stopped, and its mask allows
only the end ids: read as success, that was a 200 "stop" with an output the spec does not match.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .structured import JSON_OPTIONS, StructuredOutput
from .tokenizer import Tokenizer

COMPILED_GRAMMARS = 128          # compiled specs kept (least recently used dropped): a spec compiles in ~1-100 ms
# llguidance's default limits, with errors that name the fault only (its verbose ones dump the parser state and
# the whole grammar into the message, which reached clients)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a spec. json_object is any JSON object; a choice is Lark alternatives of JSON
    string literals (llguidance's Lark takes JSON escapes, so any string is quoted exactly)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(text) for text in spec))
    return llguidance.LLMatcher.grammar_from_lark(spec)


def check(structured: StructuredOutput) -> None:
    """Raise ValueError naming what is wrong with a spec's schema, regex or grammar (no tokenizer needed, so a
    command line or a request body is checked before any model work)."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_text(structured), limits=LIMITS)
    except ValueError as exc:                       # a schema llguidance cannot read as JSON
        problem = str(exc)
    if problem:
        raise compile_error(structured, problem)


def compile_error(structured: StructuredOutput, problem: str) -> ValueError:
    return ValueError(f"the {structured.kind} constraint does not compile: {one_line(problem)}")


def one_line(problem: str) -> str:
    """llguidance's reason, which spans lines (the source with a caret under the fault), on one line, without
    the "<non-verbose/>" marker that stands for the state it leaves out."""
    return re.sub(r"\s*\n\s*", " | ", problem.replace("<non-verbose/>", "").strip())


class ConstraintBroken(ValueError):
    """A row's matcher hit one of llguidance's limits partway: the row cannot keep its spec any further."""


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary (V ids; a model may have more ids than its
    tokenizer has tokens, which are never allowed). Safe to use from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of our tokenizer (built on first use: ~0.5 s for a 50k vocabulary)."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self.vocab_size,
                                                        eos_token=sorted(self._tokenizer.end_ids))
        return self._ll_tokenizer

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the start of the spec, compiled once (later calls copy nothing: use `row_grammar`).
        Raises ValueError naming what is wrong with the spec."""
        with self._lock:
            matcher = self._compiled.get(structured)
            if matcher is not None:
                self._compiled.move_to_end(structured)
                return matcher
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_text(structured), log_level=0,
                                           limits=LIMITS)
            if matcher.is_error():
                raise compile_error(structured, matcher.get_error())
            self._probe(structured, matcher)
            self._compiled[structured] = matcher
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return matcher

    def _probe(self, structured: StructuredOutput, matcher: llguidance.LLMatcher) -> None:
        """Refuse a spec that runs out of llguidance's budget on a row's first two steps or on the next row's
        first mask: the first mask of a huge counted repetition spends the shared lexer's budget and errs only
        on the next copy; a huge repetition of a Lark rule errs on its first token's forced tokens."""
        bitmask = allocate_token_bitmask(1, self.vocab_size)        # (1, ceil(V / 32)) int32, bit t = token t
        first, second = matcher.deep_copy(), matcher.deep_copy()
        fill_next_token_bitmask(first, bitmask, 0)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.vocab_size])
        token = next((int(t) for t in allowed if t not in self._tokenizer.end_ids), None)
        if token is not None and first.consume_token(token):
            fill_next_token_bitmask(first, bitmask, 0)
        fill_next_token_bitmask(second, bitmask, 0)
        for row in (first, second):
            if row.is_error():
                raise ValueError(f"the {structured.kind} constraint is too complex to enforce: "
                                 f"{one_line(row.get_error())}")

    def forget(self, structured: StructuredOutput, matcher: llguidance.LLMatcher) -> None:
        """Drop a compiled spec a row's copy of `matcher` broke on (a later request compiles it afresh)."""
        with self._lock:
            if self._compiled.get(structured) is matcher:
                del self._compiled[structured]

    def row_grammar(self, structured: StructuredOutput) -> RowGrammar:
        """A fresh matcher for one row (a copy of the compiled one)."""
        compiled = self.compile(structured)
        return RowGrammar(compiled.deep_copy(), self.vocab_size, structured.kind,
                          lambda: self.forget(structured, compiled))


class RowGrammar:
    """One row's matcher: it has consumed the row's output tokens, in order. Each call raises ConstraintBroken
    once the matcher is in error (a limit hit partway), never a mask or a `finished` read off an errored one."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, kind: str = "grammar",
                 on_broken: Callable[[], None] = lambda: None):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._kind = kind
        self._on_broken = on_broken                                  # the compiler forgets the spec
        self._consumed = 0
        self._bitmask = allocate_token_bitmask(1, vocab_size)       # (1, ceil(V / 32)) int32, bit t = token t

    def _check(self) -> None:
        if self._matcher.is_error():
            self._on_broken()
            raise ConstraintBroken(f"the {self._kind} constraint could not be kept after {self._consumed} "
                                   f"tokens: {one_line(self._matcher.get_error())}")

    def allowed(self, guesses: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """bool (V,): the tokens allowed after the output so far and then `guesses` (which the matcher takes
        and rolls back; they must be allowed ones, as a masked draft's are)."""
        matcher = self._matcher
        self._check()
        if guesses and not matcher.consume_tokens(list(guesses)):
            raise ValueError(f"the grammar refused guessed tokens {list(guesses)}: {one_line(matcher.get_error())}")
        fill_next_token_bitmask(matcher, self._bitmask, 0)
        self._check()                                  # an errored matcher's mask is the end ids alone
        if guesses:
            matcher.rollback(len(guesses))
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]   # (V,) 0/1
        return torch.from_numpy(bits.astype(np.bool_))

    def consume(self, token: int) -> None:
        """Take the token the row emitted (always an allowed one: the mask made sure)."""
        self._check()
        if not self._matcher.consume_token(token):
            self._check()
            raise ValueError(f"the grammar refused token {token}: {one_line(self._matcher.get_error())}")
        self._consumed += 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar would take from here, consuming none."""
        return self._matcher.validate_tokens(tokens)

    @property
    def finished(self) -> bool:
        """The spec is complete and can take nothing more: the row ends here (an errored matcher also reads as
        stopped: it raises instead)."""
        self._check()
        return self._matcher.is_stopped()
