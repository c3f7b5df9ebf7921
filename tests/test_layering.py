"""The imports keep the layers apart: server -> engine -> scheduler/kernels, the scheduler never
imports torch, and only benchmarks and tests import benchmarks."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package, forbidden", [
    ("scheduler", ("torch", "engine", "server", "kernels", "benchmarks")),
    ("kernels", ("engine", "server", "scheduler", "benchmarks")),
    ("engine", ("server", "benchmarks")),
    ("server", ("benchmarks",)),
])
def test_imports_go_one_way(package, forbidden):
    for path in python_files(package):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert top not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_every_scheduler_module_loads_without_torch():
    modules = [p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in python_files("scheduler")]
    code = f"import sys; import {', '.join(modules)}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_cpu_engine_loads_without_triton():
    """triton is imported only for weights on a CUDA device (engine/quant/int4.py)."""
    code = ("import sys; import engine.engine, engine.quant, kernels.triton; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
