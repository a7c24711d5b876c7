"""The serving loop: the engine steps on its own thread; HTTP handlers hand it requests and read their outputs.

    ticket = loop.submit(request)        # on the event loop; Overloaded (-> 429) or Draining (-> 503)
    async for step in ticket.outputs():  # list[StepOutput] per step until the request finishes
        ...
    loop.abort(ticket)                   # the client left: its rows leave the batch at the next step

Every engine call happens on the loop's thread, between steps: the inbox carries new requests and aborts in.
At most `max_pending` requests are in flight (waiting or running); past that, `submit` refuses at once, so
memory stays bounded under any load. `drain` refuses new work and waits for the in-flight requests to end;
those left at its deadline end with a RequestFailed.
A request the engine failed (serving it raised; engine.py) gets its own RequestFailed, and no other does; only
a step that raises outside any request's work (a bug in the engine) fails every request in flight.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..engine import Engine
from ..request import Request, StepOutput
from .metrics import Metrics

IDLE_WAIT_S = 0.05
EXPIRE_WAIT_S = 2.0      # how long drain waits, past its deadline, for the loop thread to end what is left
T = TypeVar("T")


def off_the_main_thread(build: Callable[[], T]) -> T:
    """build() run on a thread that then ends: load here what the serving thread will run (the model, its engine).

    Our kernels and torch run on OpenMP, and libgomp keeps one pool of worker threads per thread that starts
    parallel work, alive until that thread ends. Once a process holds more pool threads than CPUs, libgomp stops
    letting them spin between parallel regions and every region pays a wake-up: with the model loaded on the main
    thread, one SmolLM2 token took 18 ms in our kernels on the serving thread instead of 6.4 (2 cores). Loaded on a
    thread that ends, the serving thread's pool is the only one."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            result["error"] = exc

    thread = threading.Thread(target=run, name="nanoinfer-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class Overloaded(Exception):
    pass


class Draining(Exception):
    pass


class RequestFailed(Exception):
    pass


@dataclass
class Ticket:
    """One submitted request as its handler sees it."""

    request: Request
    events: asyncio.Queue                 # list[StepOutput] per step, then None; or a RequestFailed
    event_loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False

    async def outputs(self) -> AsyncIterator[list[StepOutput]]:
        while True:
            event = await self.events.get()
            if event is None:
                return
            if isinstance(event, RequestFailed):
                raise event
            yield event


class ServingLoop:
    def __init__(self, engine: Engine, max_pending: int = 256, model_name: str = ""):
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = Metrics(engine.stats().kv_budget_bytes, model_name)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()      # ("add" | "abort", Ticket)
        self.tickets: dict[int, Ticket] = {}                      # request id -> ticket, loop thread only
        self.outbox: dict[asyncio.AbstractEventLoop, list] = {}  # event loop -> (queue, event) to hand over
        self.pending = 0                                          # submitted and not yet ended
        self.pending_lock = threading.Lock()
        self.draining = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoinfer-engine", daemon=True)

    # ---- the handlers' side (event loop thread) ----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and not self.draining

    def submit(self, request: Request) -> Ticket:
        with self.pending_lock:
            if self.draining:
                raise Draining("the server is shutting down; retry on another instance")
            if self.pending >= self.max_pending:
                raise Overloaded(f"the server has {self.pending} requests in flight (its limit); retry later")
            self.pending += 1
        ticket = Ticket(request, asyncio.Queue(), asyncio.get_running_loop())
        self.inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        if not ticket.done:
            self.inbox.put(("abort", ticket))

    def drain(self, timeout: float) -> None:
        """Refuse new requests, wait (up to `timeout` s) for in-flight ones to end, then stop the thread."""
        with self.pending_lock:
            self.draining = True
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        # past the deadline, what is left ends now with an error its client reads (a stream: an error chunk and
        # [DONE]), before the sockets close; the loop thread does it between steps
        if self.pending and self.thread.is_alive():
            self.inbox.put(("expire", None))
            while self.pending and self.thread.is_alive() and time.monotonic() < deadline + EXPIRE_WAIT_S:
                time.sleep(0.01)
        self.stopped.set()
        self.thread.join(timeout=5)

    # ---- the engine's side (loop thread) -----------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped.is_set():
            self._take_inbox(wait=not self.engine.has_work)
            if self.engine.has_work:
                self._step()
            self._flush()

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine's own bug: its requests fail, not the server
            traceback.print_exc(file=sys.stderr)
            self._fail_all(RequestFailed(f"the engine failed: {exc}"))
            return
        self.metrics.observe("step_seconds", time.perf_counter() - started)
        self._dispatch(outputs)

    def _take_inbox(self, wait: bool) -> None:
        items = []
        try:
            if wait:
                items.append(self.inbox.get(timeout=IDLE_WAIT_S))
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        for action, ticket in items:
            if action == "expire":                 # drain's deadline passed
                self._fail_all(RequestFailed("the server shut down before this request finished (its drain "
                                             "timeout passed); retry on another instance"))
            elif action == "add":
                self.tickets[ticket.request.request_id] = ticket
                self.engine.submit(ticket.request)
                with self.metrics.lock:
                    self.metrics.prompt_tokens += ticket.request.prompt_len
            elif ticket.request.request_id in self.tickets:
                self.engine.abort(ticket.request)
                self._end(ticket, None, "aborted")
        self._record_gauges()

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        by_request: dict[int, list[StepOutput]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        now = time.perf_counter()
        with self.metrics.lock:
            self.metrics.generation_tokens += sum(out.token is not None for out in outputs)
        for request_id, mine in by_request.items():
            ticket = self.tickets[request_id]
            if ticket.request.error is not None:
                print(f"request {request_id} failed:", file=sys.stderr)
                traceback.print_exception(ticket.request.error, file=sys.stderr)
                self._end(ticket, RequestFailed(f"the request failed: {ticket.request.error}"), "failed")
                continue
            if ticket.first_token_at is None:
                ticket.first_token_at = now
                self.metrics.observe("time_to_first_token_seconds", now - ticket.arrival)
                self._count_prefix_lookup(ticket.request)
            else:
                self.metrics.observe("inter_token_seconds", now - ticket.last_token_at)
            ticket.last_token_at = now
            self._send(ticket, mine)
            if ticket.request.finished:
                self.metrics.observe("request_seconds", now - ticket.arrival)
                self._end(ticket, None, "finished")
        self._record_gauges()

    def _fail_all(self, error: RequestFailed) -> None:
        for ticket in list(self.tickets.values()):
            self.engine.abort(ticket.request)
            self._end(ticket, error, "failed")

    def _end(self, ticket: Ticket, error: RequestFailed | None, outcome: str) -> None:
        del self.tickets[ticket.request.request_id]
        ticket.done = True
        self._send(ticket, error)
        self.metrics.count(outcome)
        with self.pending_lock:
            self.pending -= 1

    def _send(self, ticket: Ticket, event) -> None:
        self.outbox.setdefault(ticket.event_loop, []).append((ticket.events, event))

    def _flush(self) -> None:
        """Hand the events of this pass to their handlers: one wake-up of each event loop, not one per request
        (32 rows: 1.7 ms of the serving thread a step, a thread switch per request, were spent here)."""
        outbox, self.outbox = self.outbox, {}
        for event_loop, events in outbox.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, events)
            except RuntimeError:      # the event loop closed under a handler: nobody is listening
                pass

    def _count_prefix_lookup(self, request: Request) -> None:
        if self.engine.reuses_prefix(request):
            with self.metrics.lock:
                self.metrics.prefix_queries += request.prompt_len
                self.metrics.prefix_hits += request.reused_tokens

    def _record_gauges(self) -> None:
        stats = self.engine.stats()
        with self.metrics.lock:
            self.metrics.queue_depth = stats.waiting
            self.metrics.running_requests = stats.running
            self.metrics.batch_rows = stats.batch_rows
            self.metrics.kv_bytes = stats.kv_bytes
            self.metrics.preemptions = stats.preemptions
            self.metrics.prompt_tokens_prefilled = stats.prompt_tokens_prefilled
            self.metrics.prompt_tokens_pending = stats.prompt_tokens_pending


def _put_all(events: list[tuple[asyncio.Queue, object]]) -> None:
    for target, event in events:
        target.put_nowait(event)
