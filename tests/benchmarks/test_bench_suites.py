"""`tandem bench <suite>` reaches every benchmark of the package by name: each module that runs as
`python -m` is a suite, its --help comes from its own parser, and no module edits sys.path."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from server.cli import BENCH_SUITES, main

ROOT = Path(__file__).resolve().parents[2]
NOT_A_BENCHMARK = {"benchmarks.update_benchmarks_doc"}  # rewrites docs/benchmarks.md from the results


def benchmark_modules() -> dict[str, ast.Module]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): ast.parse(path.read_text())
            for path in sorted((ROOT / "benchmarks").rglob("*.py")) if path.name != "__init__.py"}


def runs_as_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
               for node in tree.body)


def test_every_module_that_runs_is_a_suite_with_a_main():
    modules = benchmark_modules()
    runnable = {name for name, tree in modules.items() if runs_as_main(tree)}
    assert set(BENCH_SUITES.values()) == runnable - NOT_A_BENCHMARK
    for name in runnable:
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in modules[name].body), name


def test_no_benchmark_touches_sys_path():
    for name, tree in benchmark_modules().items():
        edits = [ast.unparse(node) for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path"]
        assert not edits, f"{name} uses sys.path: it runs as `python -m {name}`"


@pytest.mark.parametrize("suite", sorted(BENCH_SUITES))
def test_each_suite_help_comes_from_its_own_parser(suite, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", suite, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: tandem bench {suite} ")


def test_bench_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(f"  {suite} " in out and module in out for suite, module in BENCH_SUITES.items())
