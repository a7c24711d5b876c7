"""Failure isolation within one step: a fault while serving one request ends that request and no other.

`StepFailures` notes this step's failed requests (`fail`, or `blame` around a request's own work) and, at the
step's end, replaces their outputs with one "error" output per unfinished row (`end`). Where a fault is found
and how the others keep their bits: `Engine.step`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from .request import Request, RequestError, RowState, StepOutput


class StepFailures:
    def __init__(self):
        self.found: dict[int, tuple[Request, str, Exception]] = {}   # request id -> request, where, exception

    def fail(self, request: Request, during: str, exc: Exception) -> None:
        """Note that serving `request` raised; it ends at the end of this step (`end`)."""
        self.found.setdefault(request.request_id, (request, during, exc))

    @contextmanager
    def blame(self, request: Request, during: str):
        """Run the block for `request`; if it raises, the request fails and the step goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - this request's fault: it ends, the others go on
            self.fail(request, during, exc)

    def failed(self, request: Request) -> bool:
        return request.request_id in self.found

    def row_failed(self, row: RowState) -> bool:
        return self.failed(row.request)

    def end(self, outputs: list[StepOutput], leave: Callable[[Request], None]) -> list[StepOutput]:
        """End this step's failed requests: their outputs of this step are replaced by one "error" output per row
        that had not finished before (token None), `leave(request)` takes their rows and caches out of the
        engine, and `request.error` says why."""
        if not self.found:
            return outputs
        dropped = {id(out.completion) for out in outputs if out.request_id in self.found}
        outputs = [out for out in outputs if out.request_id not in self.found]
        for request, during, exc in self.found.values():
            request.error = RequestError(f"{during} failed: {type(exc).__name__}: {exc}")
            request.error.__cause__ = exc
            for row in request.rows:
                done = row.completion
                if done.finish_reason is None or id(done) in dropped:
                    done.finish_reason = "error"
                    outputs.append(StepOutput(done.row, None, 0, None, [], "", "error", done, request.request_id))
            leave(request)
        return outputs
