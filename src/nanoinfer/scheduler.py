"""Continuous batching, without torch: which requests wait, which prefill, which decode, and who is preempted.

Requests move waiting -> prefilling -> running -> gone. Each step (`schedule`) the scheduler

1. makes the running batch fit the KV budget at its next length, preempting the newest request while it does
   not (preemption by recompute: its rows leave the cache and it goes back to the head of the queue);
2. gives the step's prefill work: chunks of `prefill_chunk` prompt tokens, first to requests already
   prefilling, then to waiting requests admitted in arrival order while the batch with their rows fits; with a
   prefix cache, an admitted request's cached prefix blocks are matched (and pinned) and its prefill starts
   after them, and a waiting request whose uncached blocks a prompt in prefill is computing (half or more of
   what it would compute) waits for them to be cached (`_waits_for`). A request's chunks of one step are one
   piece: the runner runs the whole step, decode rows and prompt pieces, in one forward.

Chunk boundaries are multiples of `prefill_chunk` from position 0 whatever the step's budget, so a prompt's
prefill cache has the same bits alone or under load. A request whose prompt is complete joins the running
batch (`start_running`); a finished request leaves it (`remove`) at once.

The memory model counts the pool's blocks (kv/budget.py's `KVBudget`, an upper bound): a request still prefilling holds its prompt's blocks;
a running request holds its prompt's full blocks once (its n rows share them) and, per row, the blocks past
them that its next step needs (its keys, plus `lookahead` draft tokens when speculating), in every layer group
of the pool; in a windowed group (Gemma 3's sliding-window layers, a rolling window) a row keeps only the
blocks of its window and of the step's new positions, so more such rows fit a budget. Idle prefix-cache blocks
count as free: the pool evicts them when it needs a block. The count is an upper bound of the blocks the
runner's tables name, so the pool never runs out inside a forward.
`KVBudget.fits_alone` refuses at the door a request that could not finish even alone, so preemption always
ends with the oldest request running.

Admission reserves what a request holds now plus one block per row, not its whole `max_tokens`: rows that grow
past that can outgrow the budget, and then the newest request is preempted and replayed exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .kv.budget import KVBudget
from .limits import MAX_ROWS
from .request import Request, RowState

if TYPE_CHECKING:
    from .kv.pool import BlockPool

PREFILL_CHUNK = 256          # prompt tokens per prefill forward
PREFILL_TOKENS_PER_STEP = 512


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
    prefill: list[PrefillChunk]
    preempted: list[Request]


class Scheduler:
    def __init__(self, budget: KVBudget, max_rows: int = MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK,
                 prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP, lookahead: int = 0,
                 prefix_pool: BlockPool | None = None):
        if prefill_chunk < 1 or max_rows < 1:
            raise ValueError(f"prefill_chunk and max_rows must be >= 1, got {prefill_chunk} and {max_rows}")
        self.budget = budget
        self.lookahead = lookahead            # draft tokens a decode step may feed after each row's next token
        self.prefix_pool = prefix_pool        # the pool whose prefix cache admission pins hits in, or None
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

    def blocks_needed(self) -> int:
        """Pool blocks the next step needs: the running rows 1 + lookahead tokens longer, and the prefill caches."""
        return self._cost(self.running + self.prefilling)

    def _cost(self, requests: Iterable[Request]) -> int:
        total = 0
        for r in requests:
            prefilling = r not in self.running
            total += self.budget.cost(r.prompt_len, [max(r.prompt_len, row.cache_len) + 1 + self.lookahead
                                                     for row in r.live_rows], prefilling,
                                      self.prefill_span if prefilling else 1 + self.lookahead)
        return total

    @property
    def prefill_span(self) -> int:
        """The most prompt tokens one forward adds to a request's prefill: a step's chunks of one request run as
        one piece, whole chunks taken while the step's prefill budget lasts (`_take_chunks`)."""
        return self.prefill_tokens_per_step + self.prefill_chunk - 1

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        preempted = self._preempt_until_fits()
        prefill = self._prefill_work(admit=not preempted)
        return ScheduledStep(self.batch_rows(), prefill, preempted)

    def _preempt_until_fits(self) -> list[Request]:
        preempted = []
        while self.blocks_needed() > self.budget.blocks and len(self.running) + len(self.prefilling) > 1:
            victim = self.prefilling.pop() if self.prefilling else self.running.pop()
            victim.prefilled = 0
            for row in victim.live_rows:
                row.fed = 0                  # it replays its output after the new prefill
            self.waiting.appendleft(victim)
            preempted.append(victim)
            self.preemptions += 1
        return preempted

    def _prefill_work(self, admit: bool) -> list[PrefillChunk]:
        """The step's prompt chunks: those of requests in prefill, then, if `admit`, of waiting ones admitted now. A
        step that preempted admits none (as vLLM's scheduler): the memory it freed is what the batch needed, and a
        victim admitted again at once would find the blocks it matched released by the engine at this step."""
        chunks: list[PrefillChunk] = []
        tokens_left = self.prefill_tokens_per_step
        for request in self.prefilling:
            tokens_left = self._take_chunks(request, tokens_left, chunks)
        computing = {name for request in self.prefilling for name in self._published_by(request)}
        deferred: list[Request] = []
        while admit and self.waiting and tokens_left > 0 and self._admits(self.waiting[0]):
            request = self.waiting.popleft()
            if self._waits_for(request, computing):
                deferred.append(request)
                continue
            # its cached prefix is named in its table, not computed; prompt logprobs need every position
            if self.reuses_prefix(request):
                request.prefix = self.prefix_pool.pin_prefix(request.prompt_ids)
                request.prefilled = request.reused_tokens = request.prefix.tokens
            self.prefilling.append(request)
            computing.update(self._published_by(request))
            tokens_left = self._take_chunks(request, tokens_left, chunks)
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def reuses_prefix(self, request: Request) -> bool:
        """Whether `request` looks its prompt up in the prefix cache (there is one, and its prompt logprobs do
        not need every position computed)."""
        return self.prefix_pool is not None and request.params.prompt_logprobs is None

    def _published_by(self, request: Request) -> list[bytes]:
        """The prefix-cache names of the full prompt blocks a prefilling request publishes when it ends."""
        if not self.reuses_prefix(request):
            return []
        return self.prefix_pool.names(request.prompt_ids, request.prompt_len // self.budget.block_tokens)

    def _waits_for(self, request: Request, computing: set[bytes]) -> bool:
        """Whether a waiting request had better wait for a prompt in prefill: the blocks that prompt is computing
        now (names in `computing`) are at least half of what this request would compute, and it will find them
        cached once that prefill ends, a step or a few later (a hit is bitwise a miss). Many clients sending one
        prompt, or one long system prompt, at once then compute it once."""
        if not self.reuses_prefix(request) or not computing:
            return False
        size = self.budget.block_tokens
        names = self.prefix_pool.names(request.prompt_ids, (request.prompt_len - 1) // size)
        cached = next((i for i, name in enumerate(names) if not self.prefix_pool.holds(name)), len(names))
        pending = next((i for i, name in enumerate(names[cached:]) if name not in computing), len(names) - cached)
        return 2 * pending * size >= request.prompt_len - cached * size

    def _admits(self, request: Request) -> bool:
        """The head of the queue may start prefill: rows and memory fit with one block per row of headroom.
        With nothing else in the engine it always may (`fits_alone` was checked when it arrived)."""
        if not self.running and not self.prefilling:
            return True
        if self.reserved_rows + len(request.live_rows) > self.max_rows:
            return False
        headroom = len(request.live_rows)
        return self._cost([*self.running, *self.prefilling, request]) + headroom <= self.budget.blocks

    def _take_chunks(self, request: Request, tokens_left: int, chunks: list[PrefillChunk]) -> int:
        """The request's next chunks while the step's budget lasts, as one piece (they run in one forward)."""
        start = request.prefilled
        while tokens_left > 0 and request.prefilled < request.prompt_len:
            # a chunk ends on a multiple of prefill_chunk (a prefix hit starts mid-way)
            end = min((request.prefilled // self.prefill_chunk + 1) * self.prefill_chunk, request.prompt_len)
            tokens_left -= end - request.prefilled
            request.prefilled = end
        if request.prefilled > start:
            chunks.append(PrefillChunk(request, start, request.prefilled))
        return tokens_left
