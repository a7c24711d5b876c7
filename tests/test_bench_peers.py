"""The benchmarks' llama.cpp peers and model choice, without llama.cpp: stand-in programs print what
llama-batched-bench prints and serve what llama-server serves, so the parsing, the process handling and the
load each side is given are checked here; `--model` is refused where it means nothing; an F32 GGUF written for
llama-quantize holds the source file's own values."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import gguf
import pytest
import torch
from conftest import small_config
from gguf import GGMLQuantizationType as QT
from test_loaders import random_canonical, write_llama_gguf

import benchmarks as bench
from benchmarks import llama_cpp, serve_suite
from benchmarks.f32_gguf import write_f32_gguf
from benchmarks.serve_suite import ServeSizes
from nanoinfer.model import Transformer
from nanoinfer.weights.gguf_loader import load_gguf


def stand_in(folder: Path, name: str, script: str) -> Path:
    """An executable `name` in `folder` running `script` with this Python."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{script}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# What llama-batched-bench -pps --output-format jsonl prints: log lines, then one JSON object per batch size.
BATCHED_BENCH = """import json, sys
args = sys.argv[1:]
open(sys.argv[0] + ".args", "w").write(json.dumps(args))
print("main: n_kv_max = 1200, n_batch = 512", file=sys.stderr)
for pl, tg in ((1, 80.0), (8, 150.0), (32, 220.0)):
    print(json.dumps({"pp": 128, "tg": 32, "pl": pl, "speed_pp": 300.0, "speed_tg": tg, "t_pp": 0.4}))
"""


def test_batched_bench_is_run_with_a_shared_prompt_and_its_jsonl_parsed(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.BATCHED_BENCH, BATCHED_BENCH)
    assert llama_cpp.find_tool(llama_cpp.BATCHED_BENCH, str(tmp_path)) == tool

    speeds = llama_cpp.batched_bench(tool, tmp_path / "m.gguf", threads=2, prompt_tokens=128, decode_steps=32,
                                     batches=(1, 8, 32))
    assert speeds.prefill_tok_s == 300.0 and speeds.decode_tok_s == {1: 80.0, 8: 150.0, 32: 220.0}
    args = json.loads(Path(f"{tool}.args").read_text())
    for flag, value in (("-m", str(tmp_path / "m.gguf")), ("-t", "2"), ("-tb", "2"), ("-npp", "128"),
                        ("-ntg", "32"), ("-npl", "1,8,32"), ("--output-format", "jsonl")):
        assert args[args.index(flag) + 1] == value, flag
    assert "-pps" in args and int(args[args.index("-c") + 1]) >= 32 * (128 + 32)


def test_a_failing_batched_bench_is_an_error_with_its_last_words(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.BATCHED_BENCH,
                    "import sys\nprint('llama_model_load: error: unknown model architecture', file=sys.stderr)\n"
                    "sys.exit(1)\n")
    with pytest.raises(RuntimeError, match="exited 1 with 0 of 3 results: .*unknown model architecture"):
        llama_cpp.batched_bench(tool, tmp_path / "m.gguf", 2, 128, 32, (1, 8, 32))


# What llama-bench -o json prints: one record per test, prompt processing (n_gen 0) at each -p size.
PROMPT_BENCH = """import json, sys
args = sys.argv[1:]
open(sys.argv[0] + ".args", "w").write(json.dumps(args))
sizes = [int(p) for p in args[args.index("-p") + 1].split(",")]
print(json.dumps([{"n_prompt": p, "n_gen": 0, "avg_ts": 100000.0 / p, "stddev_ts": 1.0} for p in sizes]))
"""


def test_llama_bench_is_run_at_every_prompt_size_and_its_json_parsed(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.BENCH, PROMPT_BENCH)
    speeds = llama_cpp.prompt_bench(tool, tmp_path / "m.gguf", threads=2, prompt_tokens=(512, 2048, 8000), repeats=2)
    assert speeds == {512: 100000.0 / 512, 2048: 100000.0 / 2048, 8000: 100000.0 / 8000}
    args = json.loads(Path(f"{tool}.args").read_text())
    for flag, value in (("-m", str(tmp_path / "m.gguf")), ("-t", "2"), ("-p", "512,2048,8000"), ("-n", "0"),
                        ("-r", "2"), ("-o", "json")):
        assert args[args.index(flag) + 1] == value, flag


def test_a_llama_bench_missing_a_size_is_an_error_with_its_last_words(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.BENCH, "import sys\nprint('error: failed to load model', file=sys.stderr)\n"
                                               "sys.exit(1)\n")
    with pytest.raises(RuntimeError, match=r"exited 1 with results for \[\] of \[512, 8000\].*failed to load"):
        llama_cpp.prompt_bench(tool, tmp_path / "m.gguf", 2, (512, 8000), 1)


def test_a_missing_program_is_named_with_where_it_was_looked_for(tmp_path):
    assert llama_cpp.find_tool(llama_cpp.SERVER, str(tmp_path)) is None
    assert llama_cpp.missing_reason(llama_cpp.SERVER, str(tmp_path)) == f"llama-server not found in --llama-cpp {tmp_path}"
    assert "on PATH (or give --llama-cpp DIR)" in llama_cpp.missing_reason(llama_cpp.SERVER, None)


# What llama-server serves to a streaming chat client: /health, then SSE chunks and a usage chunk. It records
# each request body so the test sees what the benchmark asked for.
SERVER = """import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
log = open(sys.argv[0] + ".bodies", "a")

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps(body) + "\\n")
        log.flush()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"delta": {"content": "a"}, "index": 0}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_llama_server_load_asks_for_exactly_max_tokens_and_counts_them(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.SERVER, SERVER)
    server = llama_cpp.llama_server(tool, tmp_path / "m.gguf", threads=2, slots=32, tokens_per_slot=512)
    try:
        measured = serve_suite.measure_load(server.url, 3, ServeSizes("m", (3,), 2, 5))
    finally:
        server.stop()
    assert server.process.returncode is not None                       # stopped
    bodies = [json.loads(line) for line in Path(f"{tool}.bodies").read_text().splitlines()]
    assert len(bodies) == 1 + 3 * 2                                    # the warm-up, then 3 clients x 2 requests
    assert all(b["ignore_eos"] and b["stream"] and "min_tokens" not in b for b in bodies)
    timed = bodies[1:]
    assert [b["max_tokens"] for b in timed] == [5] * 6
    assert measured["tok_s"] == pytest.approx(6 * 5 / measured["seconds"])
    assert 0 < measured["ttft_p50"] <= measured["ttft_max"] <= measured["seconds"]


def test_a_llama_server_that_exits_at_start_is_an_error_with_its_log(tmp_path):
    tool = stand_in(tmp_path, llama_cpp.SERVER, "import sys\nprint('error: failed to load model')\nsys.exit(1)\n")
    with pytest.raises(RuntimeError, match="llama-server exited 1: error: failed to load model"):
        llama_cpp.llama_server(tool, tmp_path / "m.gguf", threads=2, slots=32, tokens_per_slot=512)


# ---- --model --------------------------------------------------------------------------------------------------
def test_model_is_refused_for_a_suite_that_does_not_take_one(tmp_path, capsys):
    assert bench.main(["memory", "--model", "x.gguf", "--out", str(tmp_path)]) == 2
    assert "--model is taken only by the suites models, serve, distance, longprompt, not memory" in capsys.readouterr().err


def test_the_models_suite_says_it_needs_a_gguf(tmp_path, capsys):
    assert bench.main(["models", "--model", "calc-nanochat", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--model calc-nanochat" in err and "nanochat model; give a .gguf file or a named GGUF model" in err


def test_the_command_line_records_model_and_llama_cpp():
    args = bench.build_parser().parse_args(["models", "--model", "a.gguf", "--llama-cpp", "/opt/bin"])
    assert bench.command_line(args).endswith("--model a.gguf --llama-cpp /opt/bin")


# ---- an F32 GGUF for llama-quantize ---------------------------------------------------------------------------
def test_an_f32_gguf_holds_the_quantized_files_values_and_metadata(tmp_path):
    config = small_config()
    quantized = write_llama_gguf(tmp_path / "q8.gguf", config, random_canonical(config, seed=3), QT.Q8_0)
    write_f32_gguf(quantized, tmp_path / "f32.gguf")

    source, f32 = gguf.GGUFReader(quantized), gguf.GGUFReader(tmp_path / "f32.gguf")
    assert {t.tensor_type.name for t in f32.tensors} == {"F32"}
    assert {t.tensor_type.name for t in source.tensors} == {"F32", "Q8_0"}
    assert f32.get_field("general.file_type").contents() == gguf.LlamaFileType.ALL_F32
    copied = [name for name in source.fields if not name.startswith("GGUF.")]
    assert all(f32.get_field(name).contents() == source.get_field(name).contents() for name in copied
               if name != "general.file_type")
    (_, weights), (_, values) = load_gguf(quantized), load_gguf(tmp_path / "f32.gguf")
    assert all(torch.equal(values[name], weights[name]) for name in weights)
    ids = torch.arange(12).view(1, 12) % config.vocab_size
    assert torch.equal(Transformer.from_state_dict(config, values)(ids),
                       Transformer.from_state_dict(config, weights)(ids))
