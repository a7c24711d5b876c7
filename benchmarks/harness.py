"""The benchmark harness: the one timing helper, tok/s, the machine record, tables, JSON, plots, progress bars.

Every suite times its workloads through `measure` (via `BenchContext.measure`), so every number in
BENCHMARKS.md was taken the same way: warm-up runs first and untimed, the device synchronized before each
clock read, and the best (shortest) of the timed runs reported, since on a shared machine interference only
ever makes a run slower.

    timing = measure(lambda: generate(ids, 64), tokens=64 * batch, warmup=lambda: generate(ids, 4), repeats=3)
    timing.tok_per_s, timing.run_seconds, timing.output      # output: what the last timed run returned
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoinfer import kernels

Clock = Callable[[], float]


def no_sync() -> None:
    """The CPU runs ops synchronously: nothing to wait for."""


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for queued work on `device`: CUDA launches are asynchronous."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return no_sync


# ---- timing -----------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """What `measure` saw: tokens produced by one run and the wall seconds of each timed run."""

    tokens: int
    run_seconds: list[float]
    output: Any = field(default=None, repr=False, compare=False)   # the last timed run's return value

    @property
    def seconds(self) -> float:
        return min(self.run_seconds)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "run_seconds": self.run_seconds,
                "tok_per_s": self.tok_per_s}


def measure(workload: Callable[[], Any], tokens: int, *, warmup: Callable[[], Any] | None = None,
            warmup_runs: int = 1, repeats: int = 1, clock: Clock = time.perf_counter,
            sync: Callable[[], None] = no_sync) -> Timing:
    """Run `warmup` (default: the workload) `warmup_runs` times untimed, then time `repeats` runs of `workload`.

    `tokens` is what one run of the workload produces (e.g. batch x new tokens); the clock is read only
    after `sync()`, so queued device work is inside the interval it belongs to.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup_runs):
        (warmup or workload)()
    sync()
    run_seconds, output = [], None
    for _ in range(repeats):
        start = clock()
        output = workload()
        sync()
        run_seconds.append(clock() - start)
    return Timing(tokens, run_seconds, output)


# ---- the machine ------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def simd_cap() -> str | None:
    """The instruction set $NANOINFER_MAX_SIMD capped the kernels to for this run (kernels applied it at import),
    or None: what a run's command, file name and CPU label must say."""
    return os.environ.get("NANOINFER_MAX_SIMD") or None


def machine_info(device: torch.device) -> dict:
    """Where the numbers came from: CPU model, cores, threads, torch, device, and how busy the machine was."""
    cpu = cpu_model()
    if simd_cap():
        cpu += f" (kernels capped to {simd_cap()})"
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "kernels": kernels.backend(),
            "torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


# ---- tables -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """One table column: the row key it shows, its header, a format spec, and an optional marker key."""

    key: str
    header: str
    fmt: str = "{}"                 # e.g. "{:,.0f}", "{:.1f}x"
    mark_key: str | None = None     # when row[mark_key] is truthy the cell gets a "*" (explained in the notes)

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None:
            return "n/a"
        text = self.fmt.format(value)
        return text + "*" if self.mark_key and row.get(self.mark_key) else text


def table_cells(columns: Sequence[Column], rows: Sequence[dict]) -> list[list[str]]:
    return [[c.cell(row) for c in columns] for row in rows]


def format_table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    """A right-aligned plain-text table for the terminal."""
    cells = [[c.header for c in columns]] + table_cells(columns, rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(text.rjust(w) for text, w in zip(r, widths)) for r in cells)


def markdown_table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_cells(columns, rows)]
    return "\n".join(lines)


# ---- results ----------------------------------------------------------------------------------------------
@dataclass
class PlotSpec:
    """A chart: grouped bars (one group per x label) or lines (x values numeric), one series per label."""

    title: str
    ylabel: str
    x_labels: list[str]
    series: dict[str, list[float | None]]
    kind: str = "bar"               # "bar" | "line"
    xlabel: str = ""
    log_y: bool = False
    x_values: list[float] | None = None   # for "line"; defaults to 0..n-1
    log_x: bool = False


@dataclass
class SuiteResult:
    """One suite's run: what the JSON file holds, plus the chart drawn from it."""

    suite: str
    title: str
    command: str
    machine: dict
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)      # suite-specific top-level fields
    plot: PlotSpec | None = None
    date: str = field(default_factory=lambda: dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    tag: str = ""                                  # tells apart runs of one suite, e.g. "threads-2"

    @property
    def stem(self) -> str:
        """The file name (without extension) of this run's JSON and PNG: the suite, and the tag if any."""
        return f"{self.suite}-{self.tag}" if self.tag else self.suite

    def to_json(self) -> dict:
        record = {"suite": self.suite, "tag": self.tag, "title": self.title, "command": self.command, "machine": self.machine,
                  "date": self.date, "columns": [asdict(c) for c in self.columns], "rows": self.rows,
                  "notes": self.notes}
        clash = set(record) & set(self.extra)
        assert not clash, f"suite fields {clash} would overwrite the common JSON fields"
        record.update(self.extra)
        return record


def columns_from_json(record: dict) -> list[Column]:
    return [Column(**c) for c in record["columns"]]


def save_plot(spec: PlotSpec, path: Path) -> None:
    """Draw `spec` to a PNG with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    if spec.kind == "bar":
        n_series = max(len(spec.series), 1)
        width = 0.8 / n_series
        for i, (label, values) in enumerate(spec.series.items()):
            xs = [g + (i - (n_series - 1) / 2) * width for g in range(len(spec.x_labels))]
            pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
            ax.bar([x for x, _ in pairs], [v for _, v in pairs], width, label=label)
        ax.set_xticks(range(len(spec.x_labels)), spec.x_labels, fontsize=8)
    elif spec.kind == "line":
        xs = spec.x_values or list(range(len(spec.x_labels)))
        for label, values in spec.series.items():
            pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
            ax.plot([x for x, _ in pairs], [v for _, v in pairs], marker="o", label=label)
        ax.set_xticks(xs, spec.x_labels, fontsize=8)
        if spec.log_x:
            ax.set_xscale("log")
            ax.set_xticks(xs, spec.x_labels, fontsize=8)
            ax.minorticks_off()
    else:
        raise ValueError(f"plot kind must be 'bar' or 'line', got {spec.kind!r}")
    if spec.log_y:
        ax.set_yscale("log")
    ax.set_title(spec.title)
    ax.set_ylabel(spec.ylabel)
    ax.set_xlabel(spec.xlabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_result(result: SuiteResult, out_dir: Path) -> tuple[Path, Path | None]:
    """Write DIR/<stem>.json and DIR/<stem>.png; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{result.stem}.json"
    json_path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    png_path = None
    if result.plot is not None:
        png_path = out_dir / f"{result.stem}.png"
        save_plot(result.plot, png_path)
    return json_path, png_path


# ---- the run's context ------------------------------------------------------------------------------------
@dataclass
class BenchContext:
    """What every suite gets: where to run, how big, and the timing helper bound to this device."""

    device: torch.device
    quick: bool
    command: str
    tag: str = ""
    model: str | None = None        # --model: the suites that take one use it instead of their default
    llama_cpp: str | None = None    # --llama-cpp: the folder of llama.cpp's programs (None: PATH)
    clock: Clock = time.perf_counter
    machine: dict = field(init=False)

    def __post_init__(self) -> None:
        self.machine = machine_info(self.device)    # taken before the suite runs: the load it started under

    def measure(self, workload: Callable[[], Any], tokens: int, **options) -> Timing:
        return measure(workload, tokens, clock=self.clock, sync=device_sync(self.device), **options)

    def progress(self, total: int, desc: str):
        """A tqdm bar on stderr (stdout carries the table)."""
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, unit="run", dynamic_ncols=True)

    def result(self, suite: str, title: str, columns: list[Column], rows: list[dict], **fields) -> SuiteResult:
        return SuiteResult(suite=suite, title=title, command=self.command, machine=self.machine,
                           columns=columns, rows=rows, tag=self.tag, **fields)
