"""`nanoinfer batch` over a Ray cluster with Ray Data (the `ray` extra: `ray[data]`), for teams that already run Ray.

    nanoinfer batch questions.jsonl answers.jsonl --model calc-nanochat --ray auto --ray-actors 4 --ray-cpus 8

reads the file (either format batch.py reads), hands the lines not yet done to
`Dataset.map_batches(BatchPredictor, concurrency=ACTORS, num_cpus=CPUS)` on the cluster at `--ray` (an address, or
auto), appends each finished line to OUTPUT.rank-0.part as its batch comes back, and merges them into OUTPUT in
input order. Resumable as without Ray: run the command again and the lines done are skipped. Ray retries the
lines of an actor that died on another actor, and since a line's seed is its own (batch.py's `line_seed`) and our
kernels are batch invariant, a retried line comes out bit-identical: the output equals a one-process run's.

`BatchPredictor` is usable on its own in a Ray Data pipeline: rows `{"line": an input line's JSON text,
"line_no": its number}` in, rows `{"result": its output line's JSON text}` out, the model loaded once per actor
(with --quant and --activations), torch's threads set to the actor's `num_cpus` (so --threads is refused with
--ray), OpenMP's idle threads waiting as the CLI's do (`WAIT_VARIABLES`). One difference from a run without Ray: a line the engine refuses
(a prompt too long for the context) is written with `error` (and no completions) instead of stopping the run,
since only the actors hold the model.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .batch import check_paths, generate, line_params, line_request, output_line, report_problems
from .batch_files import PartFile, finished_lines, merge, parse_line, part_path, part_paths, read_input
from .frontend.notices import note

# how OpenMP's idle threads wait, as the CLI set it here (cli/threads.py) before torch loaded: the actors' torch loads
# with the same, so an actor's threads do not spin away the cores they share (the actors' environment, not ours)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class RayJob:
    """What every actor needs to answer lines as `nanoinfer batch` would: the model and the command's flags."""

    model: str
    quant: str
    openai: bool              # the lines are OpenAI batch lines (batch_openai.py), else ours (batch_files.py)
    seed: int
    base_fields: dict         # the sampling flags as SamplingParams fields (ours only)
    n: int
    raw: bool
    use_tools: bool
    max_rows: int
    activations: str = "auto"  # --activations: auto, f32, or int8 (quantized weights only)


class BatchPredictor:
    """A Ray Data callable class: `Dataset.map_batches(BatchPredictor, fn_constructor_kwargs={"job": job},
    concurrency=N, num_cpus=T, batch_size=B)`. Loads the engine once per actor; each batch of lines runs
    continuously batched, like one process of `nanoinfer batch`."""

    def __init__(self, job: RayJob):
        import ray
        import torch

        from . import weights
        from .engine import Engine

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if cpus:
            torch.set_num_threads(max(1, int(cpus)))         # the actor's share of its node, not the node
        self.job = job
        model, tokenizer = weights.load(job.model, quant=job.quant, activations=job.activations)
        if tokenizer is None:
            raise ValueError(f"model {job.model!r} has no tokenizer, so it cannot take text prompts")
        self.engine = Engine(model, tokenizer, max_rows=job.max_rows)

    def __call__(self, batch: dict) -> dict:
        collected = _Lines()
        items = [self._item(str(text), int(line_no)) for text, line_no in zip(batch["line"], batch["line_no"])]
        writes = {line.key: write for line, _, write in items}
        generate(self.engine, [(line, requests) for line, requests, _ in items], collected,
                 lambda line, requests: writes[line.key](requests), "ray", show=False)
        return {"result": [line.decode() for line in collected.lines]}

    def _item(self, text: str, line_no: int):
        """(line, its engine requests, requests -> its output line) for one input line."""
        job, engine = self.job, self.engine
        if job.openai:
            from .batch_openai import line_requests, parse_batch_line
            from .batch_openai import output_line as openai_output_line

            line = parse_batch_line(text.encode(), line_no)   # checked by the driver already
            writer, refused = line_requests(engine, job.model, job.seed, line)
            return line, [] if writer is None else writer.requests, \
                lambda _requests: openai_output_line(line, writer, refused)
        line = parse_line(text.encode(), line_no)             # checked by the driver already
        params, n = line_params(job.base_fields, job.n, job.seed, line)
        try:
            request = line_request(engine, line, params, n, job.raw, job.use_tools)
        except ValueError as exc:
            record = {"id": line.id, "prompt_ids": [], "completions": [], "error": str(exc)}
            return line, [], lambda _requests: (json.dumps(record) + "\n").encode()
        return line, [request], lambda requests: output_line(line, requests[0])


class _Lines:
    """A stand-in for a part file: the output lines `generate` appends, in memory."""

    def __init__(self):
        self.lines: list[bytes] = []

    def append(self, lines: list[bytes]) -> None:
        self.lines += lines


def run_ray_batch(args: argparse.Namespace, base_fields: dict, openai: bool) -> int:
    """`nanoinfer batch ... --ray ADDRESS`: the lines not yet done, answered on the cluster, merged in order."""
    from .kernels.int8 import CHOICES, check_activations

    if args.ray_actors < 1 or args.ray_cpus <= 0 or args.ray_batch_lines < 1:
        raise ValueError("--ray-actors and --ray-batch-lines must be >= 1 and --ray-cpus > 0")
    if args.threads:
        raise ValueError("--threads does not apply with --ray: each actor runs on --ray-cpus threads")
    check_activations(args.activations, CHOICES)
    try:
        import ray
        import ray.data  # the extra is ray[data]
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'nanoinfer[ray]'") from None
    input_path, output = Path(args.input), Path(args.output)
    check_paths(input_path, output)
    seed = 0 if args.seed is None else args.seed
    if openai:
        from .batch_openai import KEY_FIELD, read_batch_file

        key_field = KEY_FIELD
        lines, problems = read_batch_file(input_path)
    else:
        key_field = "id"
        lines, problems = read_input(input_path)
        for line in list(lines):
            try:
                line_params(base_fields, args.n, seed, line)
            except ValueError as exc:
                problems.append((line.line_no, str(exc)))
                lines.remove(line)
    report_problems([f"{input_path}:{line_no}: {why}" for line_no, why in sorted(problems)], args.skip_bad_lines,
                    0)
    done_before = finished_lines([output, *part_paths(output)], key_field)
    source = input_path.read_bytes().split(b"\n")        # as read_input numbers lines
    todo = [{"line": source[line.line_no - 1].decode(), "line_no": line.line_no}
            for line in lines if line.key not in done_before]
    job = RayJob(args.model, args.quant, openai, seed, base_fields, args.n, args.raw, not args.no_tools,
                 args.max_rows, args.activations)
    part = PartFile(part_path(output, 0))
    try:
        if todo:
            ray.init(address=args.ray, logging_level="ERROR", log_to_driver=False)
            results = ray.data.from_items(todo).map_batches(
                BatchPredictor, fn_constructor_kwargs={"job": job}, concurrency=args.ray_actors,
                num_cpus=args.ray_cpus, batch_size=args.ray_batch_lines,
                runtime_env={"env_vars": {name: os.environ[name] for name in WAIT_VARIABLES if name in os.environ}})
            for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
                part.append([str(text).encode() for text in batch["result"]])
    finally:
        part.close()
    merge(output, [line.key for line in lines], finished_lines([output, *part_paths(output)], key_field))
    note(f"wrote {output}: {len(lines)} lines ({len(lines) - len(todo)} done by an earlier run"
         + (f", {len(problems)} malformed lines skipped)" if problems else ")"))
    return 0
