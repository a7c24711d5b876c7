"""The model runner: the running batch's block tables, prefill chunks, decode steps, rows joining and leaving.

It keeps one `PagedCache` whose row i holds `rows[i]` (the scheduler's batch order) and one batch-1 prefill
cache per request whose prompt is being prefilled, all in one `BlockPool`. Rows move by table entries, never by
keys (kv_tables.py):

- a prompt is prefilled at batch 1, chunk by chunk, starting after the prefix-cache blocks it matched (named in
  its table, not copied), then its table is appended to the batch once per sample (`extend`), the samples
  sharing its blocks;
- finished, aborted or preempted rows leave at once (`keep_rows`), releasing their blocks;
- a decode forward that raises runs again one request at a time, so the request that raises is found and
  leaves the batch while the others go on with the bits they would have had (`_decode_each_request`).

A row's bits never depend on its batch-mates (fixed-block decode projections, per-row attention; model.py), so
a request in the running batch gets the tokens and logprobs it gets alone (docs/design.md, exactness contract 3).
"""

from __future__ import annotations

import torch

from .kv_pool import BlockPool
from .kv_tables import PagedCache
from .model import Transformer
from .request import Request, RowState


class ModelRunner:
    def __init__(self, model: Transformer, pool: BlockPool, prefix_caching: bool = False):
        self.model, self.pool, self.prefix_caching = model, pool, prefix_caching
        self.cache = model.new_cache(0, pool)
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
        self.pool.release_tables(request.prefix_blocks)    # matched but never named in a cache
        request.prefix_blocks = []
        self.keep([row for row in self.rows if row.request is not request])

    def join(self, request: Request) -> None:
        """Its prompt is prefilled: its table joins the batch once per live row, the rows sharing its blocks."""
        prefill_cache = self.prefill_caches.pop(request.request_id)
        if self.prefix_caching:
            self.pool.publish(request.prompt_ids, prefill_cache.tables[0], prefill_cache.lengths[0])
        rows = request.live_rows
        self.cache.extend(prefill_cache, copies=len(rows))
        self.rows += rows

    # ---- forwards ---------------------------------------------------------------------------------------
    def prefill(self, request: Request, start: int, end: int, every_position: bool = False) -> torch.Tensor:
        """Run prompt tokens [start, end) of `request` at batch 1; the logits after its last token (1, V), or
        after each of its tokens (end - start, V) with `every_position` (for prompt logprobs).
        A request's first chunk starts a prefill cache, holding the prefix-cache blocks it matched, if any."""
        if request.request_id not in self.prefill_caches:
            cache = self.model.new_cache(1, self.pool)
            if request.prefix_blocks:       # the matched blocks' references pass to the tables
                cache.tables[0] = request.prefix_blocks
                cache.lengths[0] = len(request.prefix_blocks[0]) * self.pool.block_tokens
            request.prefix_blocks = []
            assert cache.lengths == [start], "a prefill starts where the reused prefix ends"
            self.prefill_caches[request.request_id] = cache
        cache = self.prefill_caches[request.request_id]
        ids = torch.tensor([request.prompt_ids[start:end]], device=self.model.device)     # (1, T)
        return self.model(ids, cache, last_only=not every_position)[0]                 # (T or 1, V)

    def decode(self, rows: list[RowState],
               drafts: list[list[int]] | None = None) -> tuple[torch.Tensor | None, dict[int, Exception]]:
        """One forward of every row's next input token, followed by its draft tokens when speculating (rows with
        fewer drafts are padded; `rollback` cuts what was not kept). Returns logits (B, T, V), T = 1 + the most
        drafts, for the rows still in the batch (`self.rows`), and the requests whose forward failed (request
        id -> exception), whose rows have left it. Each kept row's `fed` advances by one (the engine adds the
        drafts it keeps)."""
        self.keep(rows)
        width = max((len(d) for d in drafts), default=0) if drafts else 0
        feeds = [[row.next_input(), *(drafts[i] if drafts else ())] for i, row in enumerate(rows)]
        ids = torch.tensor([f + [0] * (1 + width - len(f)) for f in feeds], device=self.model.device)  # (B, T)
        failures: dict[int, Exception] = {}
        try:
            logits = self.model(ids, self.cache, last_only=width == 0)                            # (B, T, V)
        except Exception:  # noqa: BLE001 - found and dropped below; the others' logits are computed again
            logits, failures = self._decode_each_request(ids, last_only=width == 0)
        for row in self.rows:
            row.fed += 1
        return logits, failures

    def _decode_each_request(self, ids: torch.Tensor, last_only: bool) -> tuple[torch.Tensor | None,
                                                                                dict[int, Exception]]:
        """The decode forward again, each request's rows on their own: which request made the batch raise?

        A forward that raised left the cache as it was (lengths move only once every layer has run; slots
        written past a row's length are never read), so it can run again. A batch forward cannot say which row
        raised, so each request's rows (ids (B, T)) run alone, in tables naming only their blocks (`subset`): a
        request that raises again fails alone; one that does not gets the logits it would have had in the
        batch, bitwise, since a row's bits never depend on its batch-mates (a transient fault thus fails
        nobody). The survivors' tables are joined back in batch order. This costs a forward per request, on the
        failure path only."""
        by_request: dict[int, list[int]] = {}              # request id -> its rows' places in the batch
        for i, row in enumerate(self.rows):
            by_request.setdefault(row.request.request_id, []).append(i)
        kept_caches, kept_logits, kept_rows, failures = [], [], [], {}
        for request_id, places in by_request.items():
            alone = self.cache.subset(places)
            try:
                kept_logits.append(self.model(ids[places], alone, last_only=last_only))   # (rows, T, V)
            except Exception as exc:  # noqa: BLE001 - this request's failure, handed to the engine
                failures[request_id] = exc
                alone.release()
                continue
            kept_caches.append(alone)
            kept_rows += [self.rows[i] for i in places]
        self.cache.release()
        for alone in kept_caches:
            self.cache.extend(alone)
        self.rows = kept_rows
        return (torch.cat(kept_logits) if kept_logits else None), failures

    def remember(self, rows: list[RowState]) -> None:
        """Put finished rows' prompts and answers into the prefix cache (a chat's next turn starts with them)."""
        for i, row in enumerate(self.rows):
            if row in rows:
                tokens = [*row.request.prompt_ids, *row.output_ids[: row.fed]]
                self.pool.publish(tokens, self.cache.tables[i], self.cache.lengths[i])

    def rollback(self) -> None:
        """After a speculative step: each row's cache back to what its `fed` says it holds."""
        self.cache.truncate_rows([row.cache_len for row in self.rows])
