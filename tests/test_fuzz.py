"""Fuzzing: schemathesis against `nanoinfer serve --model calc-nanochat` on 127.0.0.1, driven by the server's own
/openapi.json. It fails on any 5xx, a request that hangs past the timeout, a response the document does not
describe (status, content type, headers, body), an invalid body that is accepted, or a method that is not
refused with 405 and Allow; and, since a stream that fails in the engine still answers 200, on any request the
server counts as failed. Bounded in examples (50 per operation, whatever the machine's speed) and time (a
run past FUZZ_TIMEOUT_S fails). A fixed seed keeps CI reproducible; NANOINFER_FUZZ_SEED picks another, and a
failure prints the curl command that reproduces it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from serving import metric, start_cli_server

pytestmark = pytest.mark.fuzz

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "negative_data_rejection",
          "missing_required_header", "unsupported_method", "allow_header_conformance")
REQUEST_TIMEOUT_S = 60          # a request slower than this is a hang (the longest answer takes a few seconds)
FUZZ_TIMEOUT_S = 300            # the whole run (about 30 s alone on 2 cores; no --max-time, which makes the
                                # number of cases, so what a seed finds, depend on the machine's speed)


def test_schemathesis_finds_nothing_against_the_servers_own_schema(tmp_path, monkeypatch):
    # one OpenMP thread: the other core is schemathesis', and a 3 MB model gains nothing from two (on a loaded
    # machine two spinning threads made answers 100x slower and long ones would read as hangs)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    proc, url = start_cli_server()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", ",".join(CHECKS),
             "--max-examples", "50", "--request-timeout", str(REQUEST_TIMEOUT_S),
             "--seed", os.environ.get("NANOINFER_FUZZ_SEED", "1"), "--workers", "1", "--no-color",
             "--generation-database", "none"],
            check=False, capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S, cwd=tmp_path)
        assert run.returncode == 0, f"schemathesis found problems:\n{run.stdout[-20000:]}\n{run.stderr[-4000:]}"
        assert metric(url, 'nanoinfer_requests_total{outcome="failed"}') == 0, "a request failed in the engine"
        assert metric(url, 'nanoinfer_requests_total{outcome="finished"}') > 0, "nothing was ever generated"
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stderr, stderr[-4000:]
