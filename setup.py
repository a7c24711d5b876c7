"""Builds nanoinfer's C kernels (src/nanoinfer/kernels/csrc) as the extension `nanoinfer._kernels`.

Plain C against Python's headers only (no torch headers). Threads run on OpenMP when the compiler accepts
`-fopenmp` (tried on a tiny file first), else on the kernels' own pthread pool (Apple's clang): one work split
either way (csrc/parallel.c), so the bits are the same; `nanoinfer._kernels.THREADS` says which was built. SIMD
code paths (AVX2/FMA and AVX-512 on x86-64, NEON on ARM64) are chosen at run time, so one build runs on any CPU of
its architecture. The extension is optional: without a C compiler the install still succeeds, and nanoinfer runs
the kernels' torch twins (slower, bit-stable only at one thread) and says so. Everything else about the package is
in pyproject.toml.
"""

import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("src/nanoinfer/kernels/csrc")
OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n"


class BuildWithThreads(build_ext):
    """build_ext with -fopenmp where the compiler compiles and links it, -pthread otherwise."""

    def build_extensions(self):
        flags = ["-fopenmp"] if self._compiles_openmp() else ["-pthread"]
        for ext in self.extensions:
            ext.extra_compile_args += flags
            ext.extra_link_args += flags
        super().build_extensions()

    def _compiles_openmp(self) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp, "probe.c")
            probe.write_text(OPENMP_PROBE)
            try:
                objects = self.compiler.compile([str(probe)], output_dir=tmp, extra_postargs=["-fopenmp"])
                self.compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=["-fopenmp"])
            except Exception:   # CompileError / LinkError, from setuptools' or distutils' module by version
                return False
        return True


setup(cmdclass={"build_ext": BuildWithThreads}, ext_modules=[Extension(
    "nanoinfer._kernels",
    sources=sorted(str(p) for p in CSRC.glob("*.c")),
    depends=sorted(str(p) for p in CSRC.glob("*.h")),
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-ffp-contract=off"],
    optional=True,
)])
