"""What the installed package needs and ships: the engine runs without the `serve` and `bench` extras, `nanoinfer
serve` without them says which extra to install, `nanoinfer bench` points to the repository's benchmarks, and
only the CLI imports the CLI (the front end, the server and the batch job import no entry point)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoinfer import weights
from nanoinfer.cli import main

ROOT = Path(__file__).resolve().parents[1]
SERVE_ONLY_MODULES = {"nanoinfer.server.app", "nanoinfer.server.openapi", "nanoinfer.server.schemas",  # fastapi,
                      "nanoinfer.server.errors", "nanoinfer.server.generation", "nanoinfer.server.routes",
                      "nanoinfer.server.running", "nanoinfer.server.state",
                      "nanoinfer.server.strict", "nanoinfer.server.structured_fields",
                      "nanoinfer.server.extensions", "nanoinfer.server.tokenize_routes",              # pydantic
                      "nanoinfer.server.info_routes", "nanoinfer.server.doors",
                      "nanoinfer.server.doors_openapi", "nanoinfer.server.anthropic_api",
                      "nanoinfer.server.responses_api", "nanoinfer.server.ollama_api"}


def package_names(specs: list[str]) -> set[str]:
    """'fastapi>=0.110' -> 'fastapi' (each package here imports under its distribution's name)."""
    return {re.match(r"[A-Za-z0-9_.-]+", spec).group() for spec in specs}


def test_the_extras_hold_the_server_and_plot_packages_and_the_core_needs_none_of_them():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = package_names(project["dependencies"])
    optional = project["optional-dependencies"]
    extras = package_names(optional["serve"] + optional["bench"]) - {"nanoinfer"}
    assert {"fastapi", "uvicorn", "pydantic", "matplotlib"} <= extras and not extras & core
    assert "nanoinfer[serve,bench]" in optional["test"], \
        "the README's `pip install -e '.[test]'` must install what the server and benchmark tests need"
    # with every extra's package unimportable, every engine module imports and a model generates
    script = f"""
import importlib, pkgutil, sys
for name in {sorted(extras)!r}:
    sys.modules[name] = None                      # `import name` now fails as if it were not installed
import nanoinfer
for module in pkgutil.walk_packages(nanoinfer.__path__, "nanoinfer."):
    if module.name not in {sorted(SERVE_ONLY_MODULES)!r}:
        importlib.import_module(module.name)
from nanoinfer.cli import main
sys.exit(main(["generate", "--model", "calc-nanochat", "--max-tokens", "8", "What is 6 times 7?"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the model generated nothing"


def test_serve_without_the_server_packages_names_the_extra_before_a_model_loads(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the server's packages were checked")

    monkeypatch.setattr(weights, "load", no_load)
    monkeypatch.setitem(sys.modules, "fastapi", None)      # as if `pip install nanoinfer` left the extra out
    assert main(["serve", "--model", "calc-nanochat"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("nanoinfer: error: nanoinfer serve needs the serve extra (fastapi not installed): "
                            "pip install 'nanoinfer[serve]'\n")


def test_nanoinfer_bench_says_how_to_run_the_suites_from_the_repository(capsys):
    assert importlib.util.find_spec("nanoinfer.bench") is None, "the package ships the engine, not the benchmarks"
    for argv, command in ((["bench", "models", "--threads", "1,2"], "python -m benchmarks models --threads 1,2"),
                          (["bench"], "python -m benchmarks SUITE"),
                          (["bench", "--help"], "python -m benchmarks --help")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"run `{command}`" in err and "pip install -e '.[bench]'" in err


def test_no_module_outside_the_cli_imports_it():
    """The CLI is an entry point: the batch job, the server and the front end it calls never import it back."""
    package = ROOT / "src" / "nanoinfer"
    importers = []
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "cli"):
            continue
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = module.rsplit(".", node.level)[0] if node.level else ""
                target = ".".join(part for part in (base, node.module) if part)
                if (target == "nanoinfer" and any(alias.name == "cli" for alias in node.names)) \
                        or target.split(".")[:2] == ["nanoinfer", "cli"]:
                    importers.append(module)
            elif isinstance(node, ast.Import) and any(alias.name.startswith("nanoinfer.cli") for alias in node.names):
                importers.append(module)
    assert importers == [], f"{importers} import the CLI"


def test_the_model_reads_a_step_plan_and_never_the_kv_pool():
    """KV memory is kv/'s: the runner (or `PagedCache.run`) plans a step's blocks before the forward, and the model
    reads the plan. Importing the model loads neither the pool nor the block tables, not even through another
    module: the whole import closure is checked in a fresh interpreter."""
    script = """
import sys
import nanoinfer.model
print("\\n".join(sorted(name for name in sys.modules if name.startswith("nanoinfer."))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"nanoinfer.model", "nanoinfer.kv.plan"} <= loaded, loaded
    assert not loaded & {"nanoinfer.kv.pool", "nanoinfer.kv.tables"}, sorted(loaded)


def test_the_scheduler_the_requests_and_the_front_end_import_without_torch():
    """docs/design.md's claim: scheduling, requests, their params and limits, the KV arithmetic and the front end
    need no torch (nor numpy): an import of either is refused, and they all load."""
    script = """
import importlib, pkgutil, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} is refused here")
sys.meta_path.insert(0, Refuse())
import nanoinfer.frontend
for name in ["nanoinfer.scheduler", "nanoinfer.request", "nanoinfer.sampling_params", "nanoinfer.limits",
             "nanoinfer.kv.budget", "nanoinfer.kv.groups", "nanoinfer.engine_stats",
             *(m.name for m in pkgutil.walk_packages(nanoinfer.frontend.__path__, "nanoinfer.frontend."))]:
    importlib.import_module(name)
print(len([m for m in sys.modules if m.startswith("nanoinfer.frontend.")]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 4, "the front end's modules were meant to be imported"
