"""`python -m benchmarks ray`: `nanoinfer batch` on a Ray cluster on this machine vs `nanoinfer batch` alone, on the
same file: what Ray costs and what a second actor buys.

The same requests (short questions; each line its own seeded sample at temperature 0.8, `max_tokens` long) run as
users run them, each a `nanoinfer batch` process timed from its start to its exit, with C = torch's threads here
(the machine's cores unless --threads) and the same --max-rows:

* `alone`: `nanoinfer batch IN OUT --threads C`;
* `ray, 1 actor`: `--ray ADDRESS --ray-actors 1 --ray-cpus C` (its torch threads follow its CPUs);
* `ray, C actors`: `--ray ADDRESS --ray-actors C --ray-cpus 1`, one per core;

with `--ray-batch-lines` = max_rows, on a one-node cluster of C CPUs started with `ray start` (ray_cluster.py)
before the first run and up until the last, as a user's cluster is. Every run answers the whole file from
nothing, and its file must equal alone's byte for byte (the suite stops if not). Each contender also runs the
file's first line alone: its fixed cost (a process, the model loaded; with Ray also connecting to the cluster,
starting the actors and loading the model in each), so `steady tok/s` = the tokens past that line over the
seconds past that run, and `overhead` = a contender's seconds less alone's. Best of `repeats` rounds, each round
every contender once, in turn. `--quick`: calc-nanochat, 8 lines of 4 tokens, one round, no first-line runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .harness import BenchContext, Column, PlotSpec, SuiteResult, Timing
from .ray_cluster import LoopbackCluster, driver_env


@dataclass(frozen=True)
class RaySizes:
    model: str
    lines: int
    max_tokens: int
    max_rows: int
    repeats: int
    first_line: bool          # also time each contender on the first line alone (its fixed cost)


FULL = RaySizes(model="smollm2-135m-instruct", lines=128, max_tokens=32, max_rows=32, repeats=2, first_line=True)
QUICK = RaySizes(model="calc-nanochat", lines=8, max_tokens=4, max_rows=4, repeats=1, first_line=False)
RUN_TIMEOUT_S = 3600          # a hang, not a budget


@dataclass(frozen=True)
class Contender:
    name: str
    flags: list[str]          # after `nanoinfer batch IN OUT` and the shared flags


def contenders(threads: int, max_rows: int, address: str) -> list[Contender]:
    ray = ["--ray", address, "--ray-batch-lines", str(max_rows)]
    found = [Contender("alone", ["--threads", str(threads)]),
             Contender("ray, 1 actor", [*ray, "--ray-actors", "1", "--ray-cpus", str(threads)])]
    if threads > 1:
        found.append(Contender(f"ray, {threads} actors", [*ray, "--ray-actors", str(threads), "--ray-cpus", "1"]))
    return found


def write_questions(path: Path, lines: int) -> Path:
    questions = [{"id": f"q{i}", "prompt": f"What is {i * 13 + 7} times {i * 31 + 4}? Show the steps."}
                 for i in range(lines)]
    path.write_text("".join(json.dumps(question) + "\n" for question in questions))
    return path


def run_batch(contender: Contender, questions: Path, answers: Path, sizes: RaySizes) -> tuple[float, bytes]:
    """One `nanoinfer batch` from nothing: (its wall seconds, the file it wrote)."""
    for stale in answers.parent.glob(f"{answers.name}*"):
        stale.unlink()
    command = [sys.executable, "-m", "nanoinfer.cli", "batch", str(questions), str(answers), "--model", sizes.model,
               "--temperature", "0.8", "--max-tokens", str(sizes.max_tokens), "--max-rows", str(sizes.max_rows),
               *contender.flags]
    start = time.perf_counter()
    done = subprocess.run(command, env=driver_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{contender.name}: `{' '.join(command)}` failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return seconds, answers.read_bytes()


def tokens_of(output: bytes) -> int:
    """The completion tokens in a `nanoinfer batch` output file."""
    return sum(len(completion["token_ids"]) for line in output.splitlines()
               for completion in json.loads(line)["completions"])


def run(ctx: BenchContext, sizes: RaySizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = {"whole": write_questions(folder / "questions.jsonl", sizes.lines)}
        if sizes.first_line:
            files["first"] = write_questions(folder / "first.jsonl", 1)
        with LoopbackCluster(node_cpus=[threads]) as cluster:
            racers = contenders(threads, sizes.max_rows, cluster.address)
            bar = ctx.progress(sizes.repeats * len(racers) * len(files), "bench ray")
            seconds: dict[tuple[str, str], list[float]] = {}
            outputs: dict[tuple[str, str], bytes] = {}
            for round_ in range(sizes.repeats):    # every contender once a round: a slow spell costs each one run
                for racer in racers:
                    for part, questions in files.items():
                        bar.set_postfix_str(f"round {round_ + 1}: {racer.name}, {part} file")
                        wall, output = run_batch(racer, questions, folder / "answers.jsonl", sizes)
                        seconds.setdefault((racer.name, part), []).append(wall)
                        outputs[(racer.name, part)] = output
                        bar.update()
            bar.close()
    for (name, part), output in outputs.items():
        if output != outputs[("alone", part)]:
            raise AssertionError(f"{name} wrote another file than alone for the {part} file: Ray changed a result")
    tokens = {part: tokens_of(outputs[("alone", part)]) for part in files}
    rows = [row(racer.name, tokens, {part: Timing(tokens[part], seconds[(racer.name, part)]) for part in files},
                sizes) for racer in racers]
    alone = rows[0]
    for r in rows:
        r["overhead_s"] = r["seconds"] - alone["seconds"]
        r["vs_alone"] = r["tok_s"] / alone["tok_s"]
        r["steady_vs_alone"] = r["steady_tok_s"] / alone["steady_tok_s"] if r["steady_tok_s"] and \
            alone["steady_tok_s"] else None
    cpu = f"{ctx.machine['cpu']}, {threads} thread(s)"
    title = (f"`nanoinfer batch` of {sizes.lines} requests on a Ray cluster on this machine vs alone ({sizes.model}, "
             f"{cpu})")
    return ctx.result("ray", title, COLUMNS, rows, notes=notes(rows, sizes, tokens, threads, cpu),
                      extra={"model": sizes.model, "lines": sizes.lines, "max_tokens": sizes.max_tokens,
                             "max_rows": sizes.max_rows, "threads": threads,
                             "commands": {racer.name: racer.flags for racer in racers},
                             "files_equal_alone": True, "ray": ray_version()},
                      plot=PlotSpec(title=f"nanoinfer batch, {sizes.lines} requests: alone vs on Ray ({cpu})",
                                    ylabel="tokens / s", x_labels=[r["contender"] for r in rows],
                                    series={"end to end": [r["tok_s"] for r in rows],
                                            "steady (past the first line's run)": [r["steady_tok_s"] for r in rows]}))


def row(name: str, tokens: dict[str, int], timings: dict[str, Timing], sizes: RaySizes) -> dict:
    whole, first = timings["whole"], timings.get("first")
    past_first = whole.seconds - first.seconds if first else 0.0
    return {"contender": name, "lines": sizes.lines, "tokens": tokens["whole"], "seconds": whole.seconds,
            "tok_s": whole.tok_per_s, "startup_s": first.seconds if first else None,
            "steady_tok_s": (tokens["whole"] - tokens["first"]) / past_first if past_first > 0 else None,
            "timings": {part: timing.to_json() for part, timing in timings.items()}}


COLUMNS = [Column("contender", "contender"), Column("tokens", "tokens"), Column("seconds", "seconds", "{:.1f}"),
           Column("tok_s", "tok/s", "{:,.1f}"), Column("vs_alone", "vs alone", "{:.2f}x"),
           Column("overhead_s", "seconds over alone", "{:+.1f}"),
           Column("startup_s", "first line alone, s", "{:.1f}"),
           Column("steady_tok_s", "steady tok/s", "{:,.1f}"), Column("steady_vs_alone", "steady vs alone", "{:.2f}x")]


def notes(rows: list[dict], sizes: RaySizes, tokens: dict[str, int], threads: int, cpu: str) -> list[str]:
    alone = rows[0]
    found = [(f"{sizes.lines} requests of {sizes.model} (each a seeded sample at temperature 0.8, at most "
              f"{sizes.max_tokens} tokens; {tokens['whole']} tokens in all), --max-rows {sizes.max_rows}, on {cpu}; "
              f"each contender a `nanoinfer batch` process timed from start to exit, best of {sizes.repeats} "
              f"round(s). Every contender's file equals alone's, byte for byte.")]
    for r in rows[1:]:
        text = (f"{r['contender']} ({cpu}): {r['seconds']:.1f} s vs alone's {alone['seconds']:.1f} s "
                f"({r['overhead_s']:+.1f} s, {r['vs_alone']:.2f}x alone's tok/s)")
        if r["startup_s"] is not None:
            text += (f"; its first-line run took {r['startup_s']:.1f} s vs {alone['startup_s']:.1f} s alone (Ray's "
                     f"fixed cost: connecting, starting the actors, a model in each)")
        if r["steady_vs_alone"]:
            text += (f"; past that, {r['steady_tok_s']:,.1f} tok/s vs alone's {alone['steady_tok_s']:,.1f} "
                     f"({r['steady_vs_alone']:.2f}x)")
        found.append(text + ".")
    found.append(f"The cluster: one node of {threads} CPU(s) started with `ray start` on 127.0.0.1 before the first "
                 f"run (not timed); Ray {ray_version()}.")
    return found


def ray_version() -> str:
    import ray

    return ray.__version__
