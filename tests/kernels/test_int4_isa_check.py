"""The INT4 matmul's NEON paths (plain and dotprod) on an x86 host: tests/kernels/int4_isa_check.cpp
compiled with Debian's aarch64 cross compiler from the kernels' own sources and flags, run under
qemu-user as a CPU with the dot product extension and as one without (which must dispatch to
plain NEON); the same check runs natively too, for the host's own paths. Marked isa: `make
test-isa` installs the tools from Debian's packages where missing (g++-aarch64-linux-gnu qemu-user)
and runs it, since compiling every kernel twice takes minutes on two cores."""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cpu import build

pytestmark = pytest.mark.isa

CHECK_SOURCE = Path(__file__).with_name("int4_isa_check.cpp")
CROSS_COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
# qemu's CPU models: `max` has every extension (asimddp among them), the Cortex-A53 is armv8.0
WITH_DOTPROD, WITHOUT_DOTPROD = "max", "cortex-a53"


def compile_check(compiler: str, machine: str, out_dir: Path, static: bool) -> Path:
    """The check program linked with every kernel source, each with its ISA flags for `machine`."""
    flags = [flag for flag in build.COMMON_FLAGS if flag != "-fvisibility=hidden"] + ["-I" + str(build.HERE)]
    jobs = [(build.HERE / source, build.isa_flags(source, machine)) for source in build.KERNEL_SOURCES]
    objects = build.compile_objects(compiler, flags, [*jobs, (CHECK_SOURCE, [])], out_dir)
    program = out_dir / "int4_isa_check"
    build.run_command([compiler, *(["-static"] if static else []), "-pthread", *objects, "-o", str(program)])
    return program


def run_check(command: list[str]) -> list[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usable:") and len(lines) > 1
    return lines


@pytest.fixture(scope="module")
def aarch64_check(tmp_path_factory) -> Path:
    if not (shutil.which(CROSS_COMPILER) and shutil.which(QEMU)):
        pytest.fail(f"{CROSS_COMPILER} or {QEMU} is not installed (Debian: g++-aarch64-linux-gnu qemu-user; "
                    "`make test-isa` installs them)")
    return compile_check(CROSS_COMPILER, "aarch64", tmp_path_factory.mktemp("aarch64"), static=True)


def test_neon_with_dotprod_matches_the_reference(aarch64_check):
    lines = run_check([QEMU, "-cpu", WITH_DOTPROD, str(aarch64_check)])
    assert lines[0].split()[1:] == ["neon_dotprod", "neon", "scalar"]
    assert any(line.startswith("neon_dotprod int8") for line in lines)


def test_neon_without_dotprod_dispatches_to_plain_neon(aarch64_check):
    lines = run_check([QEMU, "-cpu", WITHOUT_DOTPROD, str(aarch64_check)])
    assert lines[0].split()[1:] == ["neon", "scalar"]
    assert any(line.startswith("neon int8") for line in lines)


def test_host_paths_match_the_reference_without_python(tmp_path):
    program = compile_check(build.default_compiler(), platform.machine(), tmp_path, static=False)
    lines = run_check([str(program)])
    assert "scalar" in lines[0].split()
