"""The model runner: the running batch's block tables, prefill tables, one forward per step, rows joining and leaving.

It keeps one `PagedCache` whose row i holds `rows[i]` (the scheduler's batch order) and one one-row prefill
table per request whose prompt is being prefilled, all in one `BlockPool`. Each step runs ONE forward
(`forward`): every running row's next token (and its draft tokens when speculating) beside every prompt chunk
of the step, from several requests, as a ragged batch of queries (the tables side by side: `PagedCache.stacked`),
so the weights are read once per step; the head runs only for the tokens whose logits are used. Rows move by
table entries, never by keys (kv/tables.py). The step's blocks are planned (`PagedCache.plan`) before the
forward, which reads only the plan: a `PoolFull` there is the scheduler's accounting gone wrong, an engine bug,
raised to the caller and never blamed on a request.


- a prompt is prefilled chunk by chunk into its own table, starting after the prefix-cache blocks it matched
  (named in its table, not copied), then its table is appended to the batch once per sample (`join`, `extend`),
  the samples sharing its blocks;
- finished, aborted or preempted rows leave at once (`keep_rows`), releasing their blocks;
- a step's forward that raises runs again one request's part at a time, so the request that raises is found and
  fails while the others go on with the bits they would have had (`_each_request_alone`).

A token's bits never depend on the other tokens of its forward (fixed-order kernels, per-query attention;
model.py), so a request beside any others gets the tokens and logprobs it gets alone (docs/design.md,
exactness contract 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv.plan import StepPlan
from .kv.pool import BlockPool
from .kv.tables import PagedCache
from .model import Transformer
from .request import Request, RowState
from .scheduler import PrefillChunk


def wanted(chunk: PrefillChunk) -> list[int]:
    """Which of a prompt chunk's tokens' logits are used: every one for prompt logprobs (each scores the next
    prompt token, the last one the first output), else the last one if it ends the prompt, else none."""
    if chunk.request.params.prompt_logprobs is not None:
        return list(range(chunk.end - chunk.start))
    return [chunk.end - chunk.start - 1] if chunk.last else []


@dataclass
class StepLogits:
    """What one step's forward gives the engine."""

    decode: torch.Tensor | None                      # (B, T, V) for the runner's rows after the step
    prefill: dict[int, torch.Tensor]                 # request id -> (len(wanted(chunk)), V)
    failures: dict[int, tuple[str, Exception]]       # request id -> (what failed, the exception)
    decode_argmax: torch.Tensor | None = None        # (B,): row b's argmax (its decode logits left unwritten),
                                                     # or -1 (its logits written); None: every row's logits


class ModelRunner:
    def __init__(self, model: Transformer, pool: BlockPool, prefix_caching: bool = False):
        self.model, self.pool, self.prefix_caching = model, pool, prefix_caching
        self.cache = PagedCache(pool)
        self.rows: list[RowState] = []                    # cache row i holds rows[i]
        self.prefill_caches: dict[int, PagedCache] = {}   # request id -> its batch-1 prompt cache

    def memory_bytes(self) -> int:
        """KV bytes allocated: the pool's storage."""
        return self.pool.memory_bytes()

    # ---- rows -------------------------------------------------------------------------------------------
    def keep(self, rows: list[RowState]) -> None:
        """Make the batch exactly `rows`, an in-order subsequence of the current rows; the others leave."""
        if rows == self.rows:
            return
        index = {id(row): i for i, row in enumerate(self.rows)}
        keep = [index[id(row)] for row in rows]
        assert keep == sorted(keep), "the runner keeps rows in batch order"
        self.cache.keep_rows(keep)
        self.rows = list(rows)

    def release(self, request: Request) -> None:
        """Drop a request's rows, its prefill cache and the prefix blocks it matched (finished, aborted or
        preempted)."""
        prefill_cache = self.prefill_caches.pop(request.request_id, None)
        if prefill_cache is not None:
            prefill_cache.release()
        if request.prefix is not None:                     # pinned but never taken over by a prefill table
            self.pool.unpin(request.prefix)
            request.prefix = None
        self.keep([row for row in self.rows if row.request is not request])

    def join(self, request: Request) -> None:
        """Its prompt is prefilled: its table joins the batch once per live row, the rows sharing its blocks."""
        prefill_cache = self.prefill_caches.pop(request.request_id)
        if self.prefix_caching:
            self.pool.publish(request.prompt_ids, prefill_cache.tables[0], prefill_cache.lengths[0])
        rows = request.live_rows
        self.cache.extend(prefill_cache, copies=len(rows))
        self.rows += rows

    # ---- the step's forward -----------------------------------------------------------------------------
    def forward(self, rows: list[RowState], drafts: list[list[int]], prefills: list[PrefillChunk],
                argmax_rows: list[bool] | None = None) -> StepLogits:
        """One forward of every new token of the step: each running row's next input token, followed by its
        draft tokens when speculating (`rollback` cuts what was not kept), beside each prefill's prompt tokens
        into its request's prefill table (a request's first prefill starts that table, holding the prefix-cache
        blocks it matched). The head runs only for the tokens whose logits are used.

        If it raises, each request's part runs again alone (`_each_request_alone`), so the request that raises
        is found and fails while the others get the bits the fused forward would have given them. Each kept
        row's `fed` advances by one (the engine adds the drafts it keeps).

        argmax_rows (no drafts only): the rows that need only their argmax, which the model may then give
        instead of their logits (`StepLogits.decode_argmax`)."""
        self.keep(rows)
        feeds = [[row.next_input(), *draft] for row, draft in zip(rows, drafts)]
        for prefill in prefills:
            self._start_prefill(prefill.request, prefill.start)
        caches = [self.cache, *(self.prefill_caches[p.request.request_id] for p in prefills)]
        prompts = [p.request.prompt_ids[p.start: p.end] for p in prefills]
        decode_tokens = sum(map(len, feeds))
        picked, at = list(range(decode_tokens)), decode_tokens          # flat indices of the logits kept
        for prefill in prefills:
            picked += [at + i for i in wanted(prefill)]
            at += prefill.end - prefill.start
        argmax_at = None
        if argmax_rows is not None and any(argmax_rows):
            assert decode_tokens == len(rows), "argmax rows take no drafts"
            argmax_at = torch.tensor(argmax_rows + [False] * (len(picked) - decode_tokens))
        stacked = PagedCache.stacked(caches)
        plan = self._plan(stacked, feeds + prompts)          # before the forward: a PoolFull is the engine's
        try:
            logits = self._run(stacked, plan, feeds + prompts, picked, argmax_at)
        except Exception:  # noqa: BLE001 - found request by request below; the others' logits are computed again
            result = self._each_request_alone(feeds, prefills, prompts)
        else:
            logits, tokens = logits if argmax_at is not None else (logits, None)    # (len(picked), V), (len(picked),)
            decode_logits, *prefill_logits = logits.split([decode_tokens, *(len(wanted(p)) for p in prefills)])
            result = StepLogits(self._by_row(decode_logits, feeds) if feeds else None,
                                {p.request.request_id: part for p, part in zip(prefills, prefill_logits)}, {},
                                None if tokens is None else tokens[:decode_tokens])
        for row in self.rows:
            row.fed += 1
        return result

    def _start_prefill(self, request: Request, start: int) -> None:
        """A request's first prefill starts its batch-1 prefill table with the prefix-cache blocks it matched."""
        if request.request_id in self.prefill_caches:
            return
        cache = PagedCache(self.pool, 1)
        if request.prefix is not None:
            cache.start_with(request.prefix)
            request.prefix = None
        assert cache.lengths == [start], "a prefill starts where the reused prefix ends"
        self.prefill_caches[request.request_id] = cache

    def _plan(self, cache: PagedCache, feeds: list[list[int]]) -> StepPlan:
        """Blocks for row b of `cache` to take the tokens feeds[b]."""
        return cache.plan([len(feed) for feed in feeds], self.model.kv_like())

    def _run(self, cache: PagedCache, plan: StepPlan, feeds: list[list[int]], picked: list[int],
             argmax_at: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward of `plan` (feeds[b] for row b of `cache`), then the cache's lengths move: logits
        (len(picked), V) after the flat tokens `picked` (with `argmax_at`: and tokens, as Transformer.run
        says)."""
        device = self.model.device
        ids = torch.tensor([token for feed in feeds for token in feed], device=device)            # (N,)
        out = self.model.run(ids, plan, torch.tensor(picked, dtype=torch.int64, device=device), argmax_at)
        cache.advance(plan)
        return out

    @staticmethod
    def _by_row(logits: torch.Tensor, feeds: list[list[int]]) -> torch.Tensor:
        """The decode rows' logits (sum of feeds' lengths, V), row after row -> (B, T, V), T = the longest feed;
        a row with fewer tokens (fewer drafts) has zeros past them, which `rollback` makes sure nobody reads."""
        width = max(map(len, feeds))
        if width == 1:
            return logits.view(len(feeds), 1, -1)
        places = torch.tensor([b * width + t for b, feed in enumerate(feeds) for t in range(len(feed))])
        return logits.new_zeros(len(feeds) * width, logits.size(-1)).index_copy_(0, places, logits) \
            .view(len(feeds), width, -1)

    def _each_request_alone(self, feeds: list[list[int]], prefills: list[PrefillChunk],
                            prompts: list[list[int]]) -> StepLogits:
        """The step's forward again, one request's part at a time: which request made it raise?

        A forward that raised left the tables' lengths as they were (lengths move only once every layer has run;
        slots written past a row's length are never read), so it can run again, planned again (its blocks are
        there already; a `PoolFull` planning it is the engine's, raised). A fused forward cannot say which
        token raised, so each request's decode rows run alone, in tables naming only their blocks (`subset`),
        and each prefill alone in its own table: a request that raises again fails alone (a prefill has then
        been tried twice); one that does not gets the logits it would have had in the fused forward, bitwise,
        since a token's bits never depend on the others (a transient fault thus fails nobody). The surviving
        rows' tables are joined back in batch order. This costs a forward per request, on the failure path
        only."""
        by_request: dict[int, list[int]] = {}              # request id -> its rows' places in the batch
        for i, row in enumerate(self.rows):
            by_request.setdefault(row.request.request_id, []).append(i)
        alone_caches = {request_id: self.cache.subset(places) for request_id, places in by_request.items()}
        self.cache.release()                               # each block named once again: no copy-on-write
        kept_caches, kept_logits, kept_feeds, kept_rows = [], [], [], []
        failures: dict[int, tuple[str, Exception]] = {}
        for request_id, places in by_request.items():
            alone = alone_caches[request_id]
            part = [feeds[i] for i in places]
            plan = self._plan(alone, part)
            try:
                kept_logits.append(self._run(alone, plan, part, list(range(sum(map(len, part))))))
            except Exception as exc:  # noqa: BLE001 - this request's failure, handed to the engine
                failures[request_id] = ("the decode forward", exc)
                alone.release()
                continue
            kept_caches.append(alone)
            kept_feeds += part
            kept_rows += [self.rows[i] for i in places]
        for alone in kept_caches:
            self.cache.extend(alone)
        self.rows = kept_rows
        prefill_logits = {}
        for prefill, prompt in zip(prefills, prompts):
            request_id = prefill.request.request_id
            cache = self.prefill_caches[request_id]
            plan = self._plan(cache, [prompt])
            try:
                prefill_logits[request_id] = self._run(cache, plan, [prompt], wanted(prefill))
            except Exception as exc:  # noqa: BLE001 - the second try's exception is the request's
                failures[request_id] = ("the prefill", exc)
        decode = self._by_row(torch.cat(kept_logits), kept_feeds) if kept_feeds else None
        return StepLogits(decode, prefill_logits, failures)

    def remember(self, rows: list[RowState]) -> None:
        """Put finished rows' prompts and answers into the prefix cache (a chat's next turn starts with them)."""
        for i, row in enumerate(self.rows):
            if row in rows:
                tokens = [*row.request.prompt_ids, *row.output_ids[: row.fed]]
                self.pool.publish(tokens, self.cache.tables[i], self.cache.lengths[i])

    def rollback(self) -> None:
        """After a speculative step: each row's cache back to what its `fed` says it holds."""
        self.cache.truncate_rows([row.cache_len for row in self.rows])
