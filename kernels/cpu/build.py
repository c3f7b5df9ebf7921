"""Compiles the CPU kernels extension (paged decode attention, the INT4 matmul) in place:
`python -m kernels.cpu.build`.

Each instruction set's kernel is its own translation unit with its own -m flags,
so the binary runs on any CPU of the build machine's architecture and picks the
best path at runtime. Exits non-zero with the compiler's message on failure.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE_NAME = "_cpu_kernels"
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                 "-Wno-maybe-uninitialized", "-Wno-uninitialized"]
X86_ISA_FLAGS = {
    # GCC 12's avx512 headers trip false (maybe-)uninitialized warnings (_mm512_undefined_*);
    # the same kernel code is checked warning-free in the other translation units.
    "isa_avx512.cpp": _AVX512_FLAGS,
    "isa_avx512_vnni.cpp": _AVX512_FLAGS + ["-mavx512vnni"],
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
}
# AArch64: NEON is baseline; the dot product extension (sdot) is dispatched at run time.
ARM_ISA_FLAGS = {"isa_neon_dotprod.cpp": ["-march=armv8.2-a+dotprod"]}
# Plain C++: everything but the Python binding (tests/kernels/int4_isa_check.cpp links these too).
KERNEL_SOURCES = ["dispatch.cpp", "int4_matmul.cpp", "thread_pool.cpp", "isa_avx512_vnni.cpp", "isa_avx512.cpp",
                  "isa_avx2.cpp", "isa_neon_dotprod.cpp", "isa_neon.cpp", "isa_scalar.cpp"]
SOURCES = ["bindings.cpp", *KERNEL_SOURCES]


class BuildError(RuntimeError):
    pass


def output_path() -> Path:
    return HERE / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _include_flags() -> list[str]:
    try:
        import pybind11
    except ImportError as exc:
        raise BuildError("pybind11 is not installed: pip install pybind11") from exc
    return ["-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"], "-I" + str(HERE)]


def default_compiler() -> str:
    return os.environ.get("CXX", "g++")


def run_command(command: list[str]) -> None:
    """Runs a compiler command; BuildError with its stderr on failure, its warnings echoed."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"command failed ({result.returncode}): {shlex.join(command)}\n{result.stderr}")
    if result.stderr.strip():
        print(result.stderr, file=sys.stderr)


def isa_flags(source: str, machine: str) -> list[str]:
    """The -m flags of one source for a target machine (platform.machine()'s names)."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return X86_ISA_FLAGS.get(source, [])
    if machine in ("aarch64", "arm64"):
        return ARM_ISA_FLAGS.get(source, [])
    return []


def compile_objects(compiler: str, flags: list[str], jobs: list[tuple[Path, list[str]]], out_dir: Path) -> list[str]:
    """Each (source, its ISA flags) compiled to an object in out_dir, one compiler per core."""
    def compile_one(job: tuple[Path, list[str]]) -> str:
        source, source_flags = job
        obj = str(out_dir / (source.stem + ".o"))
        run_command([compiler, *flags, *source_flags, "-c", str(source), "-o", obj])
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, jobs))


def build(compiler: str | None = None) -> Path:
    compiler = compiler or default_compiler()
    target = output_path()
    jobs = [(HERE / source, isa_flags(source, platform.machine())) for source in SOURCES]
    with tempfile.TemporaryDirectory(prefix="tandem-cpu-build-") as build_dir:
        objects = compile_objects(compiler, [*COMMON_FLAGS, *_include_flags()], jobs, Path(build_dir))
        # Link to a temporary name first so a failed build never leaves a half-written module.
        partial = target.with_suffix(".tmp")
        run_command([compiler, "-shared", "-pthread", *objects, "-o", str(partial)])
        os.replace(partial, target)
    return target


def main() -> int:
    try:
        target = build()
    except (BuildError, OSError) as exc:
        print(f"error: building the CPU attention kernel failed:\n{exc}", file=sys.stderr)
        return 1
    print(f"built {target.relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
