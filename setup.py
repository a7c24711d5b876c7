"""Builds nanoinfer's C kernels (src/nanoinfer/kernels/csrc) as the extension `nanoinfer._kernels`.

Plain C against Python's headers only (no torch headers), with OpenMP; AVX2/FMA (and AVX-512) code paths are chosen
at run time, so one build runs on any x86-64 CPU. The extension is optional: without a C compiler the install
still succeeds, and nanoinfer runs the kernels' torch twins (slower, bit-stable only at one thread) and says so.
Everything else about the package is in pyproject.toml.
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("src/nanoinfer/kernels/csrc")

setup(ext_modules=[Extension(
    "nanoinfer._kernels",
    sources=sorted(str(p) for p in CSRC.glob("*.c")),
    depends=sorted(str(p) for p in CSRC.glob("*.h")),
    extra_compile_args=["-O3", "-fopenmp", "-std=c11", "-Wall", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
    optional=True,
)])
