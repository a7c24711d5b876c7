"""`nanoinfer batch INPUT.jsonl OUTPUT.jsonl`: completions for every line of a file, with continuous batching in
each process, sharded across processes and machines by torchrun, resumable after a crash or a kill.

    nanoinfer batch questions.jsonl answers.jsonl --model calc-nanochat -n 4 --temperature 0.7 --seed 1
    torchrun --standalone --nproc_per_node 8 -m nanoinfer.cli batch questions.jsonl answers.jsonl -n 4
    # two machines (run on each, NODE_RANK 0 and 1; HOST:PORT is reachable from both, e.g. node 0's address)
    torchrun --nnodes 2 --node_rank NODE_RANK --nproc_per_node 8 --rdzv_backend c10d \\
        --rdzv_endpoint HOST:29500 --rdzv_id answers -m nanoinfer.cli batch questions.jsonl answers.jsonl -n 4

The input format is in batch_files.py; OpenAI's batch-file format (custom_id, method, url, body) is read too, in
batch_openai.py, and run by the same shards, resume and merge below (`run_shards`). Each output line keeps its input's id and holds `prompt_ids` and one
completion per sample: row, seed, text, finish_reason, token_ids, masks (1 sampled, 0 forced by a tool),
logprobs (each sampled token's; None where forced), top_logprobs (with --logprobs N > 0) and tool_calls. A line
whose serving raised (engine.py: it fails alone) has `error`, and its unfinished rows finish_reason "error".

- Seeds: a line without its own `seed` param samples with one derived from (--seed, default 0; its id), so its
  output depends on neither the number of ranks nor its batch-mates (our kernels are batch invariant):
  1 rank or 16 give the same file.
- Sharding: the i-th well-formed line goes to rank i mod WORLD_SIZE. Every rank reads and checks the whole
  input (bad lines are the same everywhere); rank K appends finished lines to OUTPUT.rank-K.part; after a
  barrier (gloo, or nccl when the model is on a GPU) rank 0 merges them in input order into OUTPUT. On several
  machines, OUTPUT's folder must be one filesystem they all share (NFS, a cluster filesystem): rank 0 reads
  every rank's part file there. INPUT may be a copy on each machine, at the same path, with the same bytes.
- Resume: run the same command again. Ids already in OUTPUT or any part file are skipped, whatever the number
  of ranks before; nothing finished is lost, no id is written twice. Resume trusts ids: with other flags or
  another model, write to another OUTPUT.
- Malformed lines (bad JSON, a missing id or prompt, an unknown or out-of-range param, a prompt too long for the
  context) are reported as INPUT:LINE: why. By default the run stops before generating (exit status 2);
  with --skip-bad-lines they are left out and every good line is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from .batch_files import InputLine, PartFile, finished_lines, merge, part_path, part_paths, read_input
from .frontend.notices import note
from .frontend.params import sampling_params
from .frontend.prompts import prompt_ids, user_prompt
from .frontend.results import completion_record

BARRIER_TIMEOUT = timedelta(hours=24)   # the slowest shard must end within it (torchrun ends a group that died)


# ---- each line's request --------------------------------------------------------------------------------
def line_seed(global_seed: int, key: str) -> int:
    """A line's seed: a 63-bit mix of the run's seed and the line's id, nothing else."""
    digest = hashlib.blake2b(f"{global_seed}:{key}".encode(), digest_size=8, person=b"nanoinfer.batch")
    return int.from_bytes(digest.digest(), "little") >> 1


def line_params(base_fields: dict, default_n: int, global_seed: int, line: InputLine):
    """(SamplingParams, n) for a line: the flags' fields (`base_fields`), its params over them, its seed, and
    each sampled token's logprob recorded unless asked for more; a ValueError if they are bad."""
    overrides = dict(line.params)
    n = overrides.pop("n", default_n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    logprobs = base_fields.get("logprobs")
    fields = {**base_fields, "logprobs": 0 if logprobs is None else logprobs, **overrides,
              "seed": overrides.get("seed", line_seed(global_seed, line.key))}
    return sampling_params(fields), n


def line_request(engine, line: InputLine, params, n: int, raw: bool, use_tools: bool):
    """The engine request of a line (text gets the chat template unless `raw`); a ValueError if the engine
    refuses it (a prompt too long for the context, n past the rows)."""
    return engine.new_request(prompt_ids(engine.tokenizer, user_prompt(line.prompt, raw)), params, n, use_tools)


def output_line(line: InputLine, request) -> bytes:
    """A finished request as one JSON line (newline included)."""
    top = request.params.logprobs not in (None, 0)
    record = {"id": line.id, "prompt_ids": request.prompt_ids,
              "completions": [completion_record(row.completion, top) for row in request.rows]}
    if request.error is not None:      # serving it raised: its rows end with finish_reason "error"
        record["error"] = str(request.error)
    return (json.dumps(record) + "\n").encode()


# ---- the run ---------------------------------------------------------------------------------------------
def run_batch(input_path: Path, output: Path, base_fields: dict, load_engine: Callable[[int], object], *, n: int = 1,
              max_rows: int = 64, seed: int = 0, raw: bool = False, use_tools: bool = True,
              skip_bad_lines: bool = False) -> int:
    """The job `nanoinfer batch` runs (cli/batch.py): completions for every line of `input_path`, into `output`.
    `base_fields` are the sampling flags as SamplingParams fields (already checked); `load_engine(max_rows)` gives
    the engine with its tokenizer, decoding at most `max_rows` rows together, once the input is checked. `n`: samples
    per line (a line's params.n overrides it); `seed`: what each line's seed mixes with its id; `raw`: a text
    prompt is fed as it is, no chat template; `use_tools`: rows run their tool calls; `skip_bad_lines`: malformed
    lines are left out rather than stopping the run."""
    # 1) arguments and the whole input, checked before the model loads
    rank = int(os.environ.get("RANK", "0"))
    check_paths(input_path, output)
    if n < 1 or max_rows < 1:
        raise ValueError(f"-n and --max-rows must be at least 1, got {n} and {max_rows}")
    lines, problems = read_input(input_path)
    checked: list[tuple[InputLine, object, int]] = []
    for line in lines:
        try:
            checked.append((line, *line_params(base_fields, n, seed, line)))
        except ValueError as exc:
            problems.append((line.line_no, str(exc)))

    # 2) each line's request: tokens, vocab, context and n checked by the engine
    engine = load_engine(max_rows)
    good: list[tuple[InputLine, object]] = []
    for line, params, line_n in checked:
        try:
            good.append((line, line_request(engine, line, params, line_n, raw, use_tools)))
        except ValueError as exc:
            problems.append((line.line_no, str(exc)))
    report_problems([f"{input_path}:{line_no}: {why}" for line_no, why in sorted(problems)], skip_bad_lines, rank)

    # 3) and 4) this rank's shard, then rank 0's merge
    return run_shards(engine, [(line, [request]) for line, request in good], output, len(problems),
                      lambda line, requests: output_line(line, requests[0]))


def check_paths(input_path: Path, output: Path) -> None:
    """A ValueError naming what is wrong with the input and output paths, before anything is read or loaded."""
    if not input_path.is_file():
        raise ValueError(f"input file not found: {input_path}")
    if output.resolve() == input_path.resolve():
        raise ValueError("the output path is the input file; give another one")
    if not output.parent.is_dir():
        raise ValueError(f"the output's folder does not exist: {output.parent}")


def run_shards(engine, good: list[tuple[object, list]], output: Path, bad_lines: int,
               write: Callable[[object, list], bytes], key_field: str = "id") -> int:
    """This rank's shard of `good` ((line, its engine requests) pairs in input order; a line has a `.key`),
    less what a previous run finished, written with `write(line, requests)` -> one output line; then rank 0
    merges every rank's part in input order. `key_field`: the output lines' field naming them (batch_files)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    if distributed:
        start_process_group(engine.model)
    done_before = finished_lines([output, *part_paths(output)], key_field)
    todo = [(line, requests) for i, (line, requests) in enumerate(good)
            if i % world == rank and line.key not in done_before]
    part = PartFile(part_path(output, rank))
    try:
        generate(engine, todo, part, write, f"rank {rank}/{world}" if distributed else "batch", show=rank == 0)
    finally:
        part.close()

    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if rank == 0:
        merge(output, [line.key for line, _ in good], finished_lines([output, *part_paths(output)], key_field))
        already = sum(line.key in done_before for line, _ in good)
        note(f"wrote {output}: {len(good)} lines ({already} done by an earlier run"
             + (f", {bad_lines} malformed lines skipped)" if bad_lines else ")"))
    if distributed:
        dist.destroy_process_group()
    return 0


def report_problems(problems: list[str], skip: bool, rank: int) -> None:
    """Name each malformed line (rank 0 only; every rank found the same), then stop unless told to skip them."""
    if not problems:
        return
    if rank == 0:
        for problem in problems:
            note(problem + ("; skipped" if skip else ""))
    if not skip:
        raise ValueError(f"{len(problems)} malformed input lines (the first: {problems[0]}); fix them, or pass "
                         "--skip-bad-lines to do the others")


def start_process_group(model) -> None:
    """Join torchrun's group (its env holds the rendezvous): gloo on CPU, nccl when the model is on a GPU."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if model.device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(model.device)
    dist.init_process_group(backend, timeout=BARRIER_TIMEOUT)


def generate(engine, todo: list, part: PartFile, write: Callable[[object, list], bytes], label: str,
             show: bool) -> None:
    """Run `todo` ((line, its engine requests) pairs) through the engine, a window of requests at a time so they
    batch; append each line's `write(line, requests)` to `part` the step its last request finishes."""
    from tqdm import tqdm

    waiting = deque(todo)
    in_flight: dict[int, tuple[object, list]] = {}          # request_id -> (line, requests)
    rows_in_flight = 0
    window = 2 * engine.stats().max_rows                    # queued rows, so admission never starves
    tokens, started = 0, time.perf_counter()
    with tqdm(total=len(todo), desc=label, unit="line", file=sys.stderr, disable=not show) as progress:
        while waiting or in_flight:
            finished = []
            while waiting and (not in_flight or rows_in_flight + rows_of(waiting[0][1]) <= window):
                line, requests = waiting.popleft()
                if not requests:               # answered without serving (an OpenAI batch line refused)
                    finished.append((line, requests))
                for request in requests:
                    engine.submit(request)
                    in_flight[request.request_id] = (line, requests)
                rows_in_flight += rows_of(requests)
            outputs = engine.step() if in_flight else []
            tokens += len(outputs)
            ended = {out.request_id for out in outputs if out.finish_reason is not None}
            for rid in sorted(ended):          # a line ends with the last of its requests
                line, requests = in_flight.get(rid, (None, []))
                if requests and all(request.finished for request in requests):
                    finished.append((line, requests))
                    for request in requests:
                        del in_flight[request.request_id]
            if finished:
                part.append([write(line, requests) for line, requests in finished])
                rows_in_flight -= sum(rows_of(requests) for _, requests in finished)
                progress.update(len(finished))
            progress.set_postfix_str(f"{tokens / (time.perf_counter() - started):.0f} tok/s", refresh=False)


def rows_of(requests: list) -> int:
    return sum(len(request.rows) for request in requests)
