"""`python -m benchmarks` (the repository's benchmarks/ package): the harness times only what it should, the suites write well-formed JSON and plots, the
seed's loops compute our tokens, and the memory formula equals allocation. Quick sizes, tiny models only; no
assertion ever depends on a measured time (fake clocks stand in where the arithmetic is checked)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks as bench
from benchmarks import cache_suite, harness, memory_suite, report
from nanoinfer import kernels
from benchmarks.seed_gpt import (
    SeedGPT,
    ours_generate_cached,
    ours_generate_uncached,
    seed_generate_cached,
    seed_generate_uncached,
)
from nanoinfer.config import tiny_gpt_config
from nanoinfer.model import Transformer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMON_KEYS = {"suite", "title", "command", "machine", "date", "columns", "rows", "notes"}
MACHINE_KEYS = {"cpu", "cores", "torch", "threads", "device"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The CPU is shared: one torch thread keeps these tests from fighting other runs for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


# ---- the harness --------------------------------------------------------------------------------------------
def test_warmup_runs_are_not_timed():
    clock = FakeClock()
    calls = []

    def workload():
        calls.append(clock.reads)
        clock.now += 100.0 if len(calls) <= 2 else 2.0    # the two warm-up calls are slow, timed calls are not
        return len(calls)

    timing = harness.measure(workload, tokens=10, warmup_runs=2, repeats=3, clock=clock)
    assert len(calls) == 5
    assert calls[:2] == [0, 0], "warm-up ran before the clock was first read"
    assert timing.run_seconds == [2.0, 2.0, 2.0]
    assert timing.output == 5, "output is the last timed run's"


def test_a_separate_warmup_workload_replaces_the_workload_in_warmup():
    clock, seen = FakeClock(), []
    harness.measure(lambda: seen.append("timed"), 1, warmup=lambda: seen.append("warm"), warmup_runs=2, repeats=1,
                    clock=clock)
    assert seen == ["warm", "warm", "timed"]


def test_tok_per_s_is_tokens_over_the_best_timed_run():
    clock = FakeClock()
    durations = iter([4.0, 1.0, 3.0])     # warm-up (untimed), then two timed runs

    def workload():
        clock.now += next(durations)

    timing = harness.measure(workload, tokens=64, repeats=2, clock=clock)
    assert timing.run_seconds == [1.0, 3.0]
    assert timing.seconds == 1.0 and timing.tok_per_s == 64.0
    assert timing.to_json() == {"tokens": 64, "seconds": 1.0, "run_seconds": [1.0, 3.0], "tok_per_s": 64.0}


def test_measure_synchronizes_before_every_clock_read():
    events = []
    clock = lambda: events.append("clock") or 0.0
    harness.measure(lambda: events.append("run"), 1, repeats=2, clock=clock, sync=lambda: events.append("sync"))
    assert events == ["run", "sync", "clock", "run", "sync", "clock", "clock", "run", "sync", "clock"]


def test_long_nocache_rows_are_extrapolated_from_the_timed_prefix_and_full_window_steps():
    clock = FakeClock()
    ctx = harness.BenchContext(torch.device("cpu"), quick=True, command="test", clock=clock)

    def fake_nocache(idx, n):           # every step costs 1 s on the fake clock
        clock.now += n
        return torch.zeros(idx.size(0), n, dtype=torch.long)

    loop = cache_suite.Loop("seed_nocache", "seed no-cache", fake_nocache, cached=False)
    sizes = cache_suite.CacheSizes((1,), (256, 1024), probe_steps=4, nocache_budget_s=100.0)
    prompt = torch.zeros(1, 8, dtype=torch.long)
    previous = (256, cache_suite.LoopRun(harness.Timing(256, [256.0], torch.zeros(1, 256, dtype=torch.long)),
                                         256, estimated=False))
    run = cache_suite.time_loop(ctx, loop, prompt, 1024, sizes, 256, previous)
    assert run.estimated and run.timed_steps == 256 + 4
    assert run.timing.seconds == 256.0 + (1024 - 256) * 1.0
    assert run.tokens.size(1) == 256, "the estimated row keeps the tokens that were really generated"


# ---- the seed's loops ---------------------------------------------------------------------------------------
def small_tiny_gpt(context: int) -> Transformer:
    config = dataclasses.replace(tiny_gpt_config(), vocab_size=128, n_layer=2, n_embd=64, n_head=4, n_kv_head=4,
                                 ffn_hidden=128, context_len=context, head_dim=0, padded_vocab_size=0)
    return Transformer.random(config, seed=3)


@pytest.mark.parametrize("model", [small_tiny_gpt(16), Transformer.random(tiny_gpt_config(), seed=0)],
                         ids=["context-16", "tiny-gpt-preset"])
def test_seed_loops_pick_our_greedy_tokens_inside_the_window(model):
    seed = SeedGPT.from_transformer(model)
    prompt = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    window = model.config.context_len
    new_tokens = min(window - 8 + 1 + 6, 24)            # past the small window, short for the preset
    inside = min(window - 8 + 1, new_tokens)
    ours = ours_generate_cached(model, prompt, new_tokens)
    for other in (seed_generate_cached(seed, prompt, new_tokens), seed_generate_uncached(seed, prompt, new_tokens),
                  ours_generate_uncached(model, prompt, new_tokens)):
        assert other.shape == ours.shape
        assert torch.equal(other[:, :inside], ours[:, :inside])


def test_agreement_check_fails_loudly_when_a_loop_differs():
    tokens = torch.arange(10)[None]
    runs = {key: cache_suite.LoopRun(harness.Timing(10, [1.0], tokens.clone()), 10, False)
            for key in ("seed_nocache", "seed_cache", "ours_nocache", "ours_cache")}
    assert cache_suite.check_agreement(runs, 10)["checked_tokens"] == 10
    runs["seed_cache"].timing.output[0, 7] = 99
    with pytest.raises(AssertionError, match="seed_cache"):
        cache_suite.check_agreement(runs, 10)


# ---- the suites end to end (quick) --------------------------------------------------------------------------
def every_suite() -> list:
    """Every suite, one whose optional feature is not installed skipped with the reason (`all` leaves it out)."""
    return [pytest.param(name, marks=pytest.mark.skipif(bench.missing_extra(name) is not None,
                                                        reason=str(bench.missing_extra(name))))
            for name in bench.SUITES]


RUNNABLE = [name for name in bench.SUITES if bench.missing_extra(name) is None]


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    assert bench.main(["all", "--quick", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("suite", every_suite())
def test_quick_suite_writes_well_formed_json(quick_out, suite):
    record = json.loads((quick_out / f"{suite}.json").read_text())
    assert COMMON_KEYS <= set(record) and record["suite"] == suite
    assert MACHINE_KEYS <= set(record["machine"]) and record["machine"]["device"] == "cpu"
    assert record["command"] == f"python -m benchmarks {suite} --device cpu --out {quick_out} --quick"
    assert record["rows"] and record["notes"]
    keys = [c["key"] for c in record["columns"]]
    for row in record["rows"]:
        assert set(keys) <= set(row), f"row lacks a column: {set(keys) - set(row)}"
    tok_s = [v for row in record["rows"] for k, v in row.items() if k.endswith("_tok_s") and v is not None]
    assert all(isinstance(v, float) and v > 0 for v in tok_s)


@pytest.mark.parametrize("suite", every_suite())
def test_quick_suite_writes_a_png_plot(quick_out, suite):
    data = (quick_out / f"{suite}.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_cache_suite_rows_record_timed_steps_and_the_window_check(quick_out):
    record = json.loads((quick_out / "cache.json").read_text())
    sizes = cache_suite.QUICK
    assert [(r["batch"], r["tokens"]) for r in record["rows"]] == \
        [(b, t) for b in sizes.batches for t in sizes.token_counts]
    for row in record["rows"]:
        assert row["timed_steps"] == {k: row["tokens"] for k in ("seed_nocache", "seed_cache", "ours_nocache",
                                                                 "ours_cache")}
        assert row["checked_tokens"] == row["tokens"] and not row["estimated"]


def test_paged_suite_runs_the_whole_mixed_load_together_under_a_2x_budget(quick_out):
    """The long prompt beside the short chats: under 2x the KV in use every request decodes at once (a dense cache
    at the longest row would not fit them), and the suite itself checked both budgets gave the same tokens."""
    record = json.loads((quick_out / "paged.json").read_text())
    by_budget = {row["budget"]: row for row in record["rows"]}
    assert by_budget["2x"]["most_rows"] == by_budget["2x"]["requests"] == by_budget["unlimited"]["most_rows"]
    assert by_budget["2x"]["preemptions"] == 0
    assert set(record["step_times"]) == {"steady_ms", "leave_ms", "join_ms", "join_prefill_alone_ms"}


def test_memory_formula_equals_allocation_and_reproduces_the_seeds_3_mib():
    ctx = harness.BenchContext(torch.device("cpu"), quick=True, command="test")
    result = memory_suite.run(ctx)
    assert all(r["matches"] for r in result.rows)
    assert all(r["allocated_bytes"] == r["formula_bytes"] for r in result.rows if not r["grown"])
    assert all(r["capacity"] > r["tokens"] for r in result.rows if r["grown"])
    assert result.extra["seed_check"]["allocated_mib"] == 3.0 == result.extra["seed_check"]["formula_mib"]
    # the Gemma shape's local layers hold their window: at 1024 tokens the last query reads positions 512..1023
    windowed = [r for r in result.rows if r["windowed"] and r["tokens"] == 1024 and r["batch"] == 1]
    assert [r["held_mib"] for r in windowed] == [2 * 256 * 4 * (3 * 1024 + 15 * 512) / 2**20]
    assert windowed[0]["without_window_mib"] == 2 * 256 * 4 * 18 * 1024 / 2**20


@pytest.mark.skipif("ray" not in RUNNABLE, reason=str(bench.missing_extra("ray")))
def test_the_ray_suite_ran_each_contender_on_the_same_file(quick_out):
    """The module runs at one thread: `alone` and one actor of one CPU, both writing the same file (the suite
    compares them itself and stops if they differ)."""
    record = json.loads((quick_out / "ray.json").read_text())
    assert [row["contender"] for row in record["rows"]] == ["alone", "ray, 1 actor"]
    assert record["files_equal_alone"] and len({row["tokens"] for row in record["rows"]}) == 1
    assert record["commands"]["ray, 1 actor"][-4:] == ["--ray-actors", "1", "--ray-cpus", "1"]


def test_all_leaves_out_a_suite_whose_feature_is_not_installed_saying_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)          # find_spec now sees Ray as not installed
    assert bench.suites_to_run("all") == [name for name in bench.SUITES if name != "ray"]
    assert "skipping the ray suite: ray is not installed (pip install -e '.[ray]')" in capsys.readouterr().err
    assert bench.main(["ray", "--quick", "--out", str(tmp_path)]) == 2
    assert "the ray suite cannot run: ray is not installed" in capsys.readouterr().err


def test_the_serve_suite_runs_nanoinfer_serve_as_a_user_runs_it(monkeypatch):
    """Each of our contenders is `nanoinfer serve` in a process of its own, with its defaults (KV bound, prefix
    cache) but --threads and --max-rows, which reach the engine."""
    from benchmarks import serve_suite
    from nanoinfer.cli.main import build_parser
    from nanoinfer.cli.serve import DEFAULT_KV_MEMORY_GB, DEFAULT_PREFIX_CACHE_GB, engine_options

    commands = []
    monkeypatch.setattr(serve_suite, "ServerProcess", lambda name, command: commands.append(command(1234)))
    serve_suite.nanoinfer_server("calc-nanochat", threads=2, max_rows=1)
    (command,) = commands
    assert command[:3] == [sys.executable, "-m", "nanoinfer.cli"]
    args = build_parser().parse_args(command[3:])
    assert (args.command, args.model, args.threads, args.port) == ("serve", "calc-nanochat", 2, 1234)
    assert engine_options(args) == {"kv_memory_bytes": int(DEFAULT_KV_MEMORY_GB * 2**30), "max_rows": 1,
                                    "prefix_cache_bytes": int(DEFAULT_PREFIX_CACHE_GB * 2**30)}


def test_report_renders_every_suite_with_tables_and_images(quick_out, tmp_path):
    markdown = report.write_report(quick_out, tmp_path / "docs" / "bench", tmp_path / "BENCHMARKS.md")
    text = markdown.read_text()
    for suite in RUNNABLE:
        assert f"## `{suite}`" in text
        assert f"](docs/bench/{suite}.png)" in text
        assert (tmp_path / "docs" / "bench" / f"{suite}.json").is_file()
    assert "python -m benchmarks cache --device cpu" in text and "|---:|" in text


# ---- the command line ---------------------------------------------------------------------------------------
def test_the_parser_reads_a_suite_and_its_flags():
    args = bench.build_parser().parse_args(["memory", "--quick", "--out", "x"])
    assert (args.suite, args.quick, args.out, args.device, args.threads) == ("memory", True, "x", "cpu", None)


def test_python_dash_m_benchmarks_runs_a_suite_from_the_repository_root(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "benchmarks", "memory", "--quick", "--threads", "1",
                           "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "memory-threads-1.json").read_text())
    assert record["command"] == f"python -m benchmarks memory --device cpu --out {tmp_path} --quick --threads 1"
    assert "KV-cache memory" in done.stdout


@pytest.mark.parametrize("suite, missing", [("memory", "matplotlib"), ("serve", "httpx"), ("all", "uvicorn")])
def test_a_missing_bench_package_is_named_before_anything_runs(suite, missing, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)        # import (and find_spec) now see it as not installed
    assert bench.main([suite, "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{missing} not installed" in err and "pip install -e '.[bench]'" in err
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_new_report_keeps_the_hand_written_summary_and_nothing_else_of_the_old_one(quick_out, tmp_path):
    markdown = tmp_path / "BENCHMARKS.md"
    summary = "## In short\n\nOurs was 2.0x theirs (2026-12-05).\n"
    markdown.write_text(f"# Benchmarks\n\nan old intro\n\n{summary}\n## `cache`: an old table\n\n| 1 |\n")
    text = report.write_report(quick_out, tmp_path / "docs" / "bench", markdown).read_text()
    assert text.count(summary) == 1 and text.index(summary) < text.index("## `cache`")
    assert "an old intro" not in text and "an old table" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when there is no CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    assert bench.main(["memory", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "torch.cuda is not available" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_thread_list_runs_each_suite_once_per_count_and_the_report_shows_both(tmp_path):
    out = tmp_path / "out"
    assert bench.main(["attention", "--quick", "--threads", "1,2", "--out", str(out)]) == 0
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(records) == {"attention-threads-1", "attention-threads-2"}
    assert [records[f"attention-threads-{n}"]["machine"]["threads"] for n in (1, 2)] == [1, 2]
    assert records["attention-threads-2"]["command"].endswith("--quick --threads 2")
    assert all(r["ours_bit_stable"] for rec in records.values() for r in rec["rows"])
    text = report.write_report(out, tmp_path / "docs", tmp_path / "BENCHMARKS.md").read_text()
    assert "## `attention` (threads-1)" in text and "## `attention` (threads-2)" in text


@pytest.mark.parametrize("bad", ["0", "two", "1,,2"])
def test_bad_thread_counts_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.main(["memory", "--threads", bad])
    assert "--threads takes positive counts" in capsys.readouterr().err


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built: nothing to cap")
def test_a_capped_run_says_so_in_its_file_name_command_and_cpu_label(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOINFER_MAX_SIMD", "portable")
    kernels.simd_cap_from_environment()
    try:
        assert bench.main(["attention", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    finally:
        kernels._kernels.cap_simd(2)
    record = json.loads((tmp_path / "attention-threads-1-simd-portable.json").read_text())
    assert record["command"].startswith("NANOINFER_MAX_SIMD=portable python -m benchmarks attention")
    assert record["machine"]["cpu"].endswith("(kernels capped to portable)")
    assert record["machine"]["kernels"].startswith("c (scalar;")
