"""Continuous batching, without torch: which requests wait, which prefill, which decode, and who is preempted.

Requests move waiting -> prefilling -> running -> gone. Each step (`schedule`) the scheduler

1. makes the running batch fit the KV budget at its next length, preempting the newest request while it does
   not (preemption by recompute: its rows leave the cache and it goes back to the head of the queue);
2. gives the step's prefill work: chunks of `prefill_chunk` prompt tokens, first to requests already
   prefilling, then to waiting requests admitted in arrival order while the batch with their rows fits; with a
   prefix cache, an admitted request's cached prefix blocks are matched (and pinned) and its prefill starts
   after them.

Chunk boundaries are multiples of `prefill_chunk` from position 0 whatever the step's budget, so a prompt's
prefill cache has the same bits alone or under load. A request whose prompt is complete joins the running
batch (`start_running`); a finished request leaves it (`remove`) at once.

The memory model mirrors the runner's dense cache: all running rows share one capacity, the longest row's
keys (plus `lookahead` draft tokens when speculating) rounded up to `capacity_step` (at most `max_keys`), so
the batch costs rows x capacity token slots, and each request still prefilling holds a batch-1 cache of its
prompt. `KVBudget.fits_alone` refuses at the door a
request that could not finish even alone, so preemption always ends with the oldest request running.

Admission reserves what a request holds now plus one capacity step per row, not its whole `max_tokens`: rows
that grow past that can outgrow the budget, and then the newest request is preempted and replayed exactly. The
step is 128 tokens, or less in a small budget (`KVBudget.for_slots`: at least MIN_STEPS_IN_BUDGET steps fit),
so a few-MB budget is usable and the reservation stays a small part of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .request import Request, RowState

PREFILL_CHUNK = 256          # prompt tokens per prefill forward
PREFILL_TOKENS_PER_STEP = 512
CAPACITY_STEP = 128          # the running cache's capacity moves in steps of this many tokens
MIN_CAPACITY_STEP = 16       # ... or as few as this in a small budget
MIN_STEPS_IN_BUDGET = 8      # a budget holds at least this many steps when it can (see KVBudget.for_slots)
MAX_ROWS = 64                # rows decoding together at most


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class KVBudget:
    """KV memory in token slots (one slot = one token's keys and values in every layer)."""

    slots: int               # what the running cache plus prefill caches may hold
    max_keys: int            # keys a row can hold: the context, or the rolling window
    capacity_step: int = CAPACITY_STEP

    @classmethod
    def for_slots(cls, slots: int, max_keys: int) -> KVBudget:
        """A budget of `slots` whose capacity step is CAPACITY_STEP, halved (down to MIN_CAPACITY_STEP) while
        fewer than MIN_STEPS_IN_BUDGET steps fit in it: with 128-token steps a 768-slot budget would reserve a
        sixth of itself per admitted row, and one under 128 slots could not hold any request."""
        step = CAPACITY_STEP
        while step > MIN_CAPACITY_STEP and step * MIN_STEPS_IN_BUDGET > slots:
            step //= 2
        return cls(slots, max_keys, step)

    def capacity(self, longest: int) -> int:
        """Slots per row of a cache whose longest row holds `longest` tokens."""
        return min(round_up(max(longest, 1), self.capacity_step), self.max_keys)

    def cost(self, rows: int, longest: int, prefill_tokens: int = 0) -> int:
        return (rows * self.capacity(longest) if rows else 0) + prefill_tokens

    def fits_alone(self, prompt_len: int, max_tokens: int, n: int) -> bool:
        """Whether a request could run to its end with nothing else in the engine."""
        return self.cost(n, prompt_len + max_tokens, prompt_len) <= self.slots


@dataclass
class PrefillChunk:
    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == self.request.prompt_len


@dataclass
class ScheduledStep:
    decode_rows: list[RowState]       # batch order: each feeds one token this step
    capacity: int                     # slots per row the running cache needs for this step
    prefill: list[PrefillChunk]
    preempted: list[Request]


class Scheduler:
    def __init__(self, budget: KVBudget, max_rows: int = MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK,
                 prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP, lookahead: int = 0, prefix_cache=None):
        if prefill_chunk < 1 or max_rows < 1:
            raise ValueError(f"prefill_chunk and max_rows must be >= 1, got {prefill_chunk} and {max_rows}")
        self.budget = budget
        self.lookahead = lookahead            # draft tokens a decode step may feed after each row's next token
        self.prefix_cache = prefix_cache      # prefix_cache.PrefixCache or None: reused prompt prefixes
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []      # admission order; their live rows form the batch in this order
        self.preemptions = 0

    # ---- queues -----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request, wherever it is."""
        for queue in (self.waiting, self.prefilling, self.running):
            if request in queue:
                queue.remove(request)

    def start_running(self, request: Request) -> None:
        """Its prompt is prefilled and its rows have joined the cache, at the end of the batch."""
        self.prefilling.remove(request)
        self.running.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def batch_rows(self) -> list[RowState]:
        """The running rows, in cache order."""
        return [row for request in self.running for row in request.live_rows]

    @property
    def reserved_rows(self) -> int:
        """Rows the batch holds or will hold once the requests in prefill join it."""
        return sum(len(r.live_rows) for r in (*self.running, *self.prefilling))

    def slots_needed(self) -> int:
        """Token slots the next step needs: the batch 1 + lookahead tokens longer, plus the prefill caches."""
        return self._cost(self.running + self.prefilling)

    def _cost(self, requests: Iterable[Request]) -> int:
        rows, longest, prefill_tokens = 0, 0, 0
        for request in requests:
            live = request.live_rows
            rows += len(live)
            longest = max([longest, request.prompt_len + 1, *(row.cache_len + 1 + self.lookahead for row in live)])
            if request in self.prefilling or request in self.waiting:
                prefill_tokens += request.prompt_len
        return self.budget.cost(rows, longest, prefill_tokens)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        preempted = self._preempt_until_fits()
        prefill = self._prefill_work()
        rows = self.batch_rows()
        longest = max((row.cache_len + 1 + self.lookahead for row in rows), default=0)
        return ScheduledStep(rows, self.budget.capacity(longest), prefill, preempted)

    def _preempt_until_fits(self) -> list[Request]:
        preempted = []
        while self.slots_needed() > self.budget.slots and len(self.running) + len(self.prefilling) > 1:
            victim = self.prefilling.pop() if self.prefilling else self.running.pop()
            victim.prefilled = 0
            for row in victim.live_rows:
                row.fed = 0                  # it replays its output after the new prefill
            self.waiting.appendleft(victim)
            preempted.append(victim)
            self.preemptions += 1
        return preempted

    def _prefill_work(self) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        tokens_left = self.prefill_tokens_per_step
        for request in self.prefilling:
            tokens_left = self._take_chunks(request, tokens_left, chunks)
        while self.waiting and tokens_left > 0 and self._admits(self.waiting[0]):
            request = self.waiting.popleft()
            # its cached prefix is copied, not computed (pinned until then); prompt logprobs need every position
            if self.prefix_cache is not None and request.params.prompt_logprobs is None:
                request.prefix_blocks = self.prefix_cache.match(request.prompt_ids)
                request.prefilled = request.reused_tokens = len(request.prefix_blocks) * self.prefix_cache.block_tokens
            self.prefilling.append(request)
            tokens_left = self._take_chunks(request, tokens_left, chunks)
        return chunks

    def _admits(self, request: Request) -> bool:
        """The head of the queue may start prefill: rows and memory fit with one capacity step of headroom.
        With nothing else in the engine it always may (`fits_alone` was checked when it arrived)."""
        if not self.running and not self.prefilling:
            return True
        if self.reserved_rows + len(request.live_rows) > self.max_rows:
            return False
        headroom = len(request.live_rows) * self.budget.capacity_step
        return self._cost([*self.running, *self.prefilling, request]) + headroom <= self.budget.slots

    def _take_chunks(self, request: Request, tokens_left: int, chunks: list[PrefillChunk]) -> int:
        while tokens_left > 0 and request.prefilled < request.prompt_len:
            start = request.prefilled      # a chunk ends on a multiple of prefill_chunk (a prefix hit starts mid-way)
            end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, request.prompt_len)
            chunks.append(PrefillChunk(request, start, end))
            request.prefilled = end
            tokens_left -= end - start
        return tokens_left
