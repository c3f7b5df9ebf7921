"""The imports keep the layers apart: server -> engine -> scheduler/kernels, the scheduler never
imports torch, and only benchmarks and tests import benchmarks. No product module imports itself
through others (a cycle), and no function outgrows a screenful or so."""
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


# ---- import cycles -------------------------------------------------------------------------
PRODUCT_PACKAGES = ("server", "engine", "scheduler", "kernels")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PRODUCT_PACKAGES for path in python_files(package)}


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `module` imports anywhere in its file: at the top, inside functions and
    under `if TYPE_CHECKING:`. `from pkg import name` imports pkg.name when that is a module, else
    pkg; a name that is no module counts as the closest package above it that is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def closest_module(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(closest_module(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` steps above this module's
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else closest_module(base))
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {module: import_edges(module, path, modules) for module, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import cycle through the component's first module, staying inside it."""
    start, inside = component[0], set(component)
    parents = {start: None}
    queue = [start]
    for node in queue:
        for target in sorted(graph[node] & inside):
            if target == start:
                cycle = [node]
                while parents[cycle[-1]] is not None:
                    cycle.append(parents[cycle[-1]])
                return [*reversed(cycle), start]
            if target not in parents:
                parents[target] = node
                queue.append(target)
    raise AssertionError(f"{component} is not strongly connected")


def test_the_import_graph_sees_imports_in_functions_and_type_checking_blocks(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg.b import B\n"
                                  "def f():\n    from pkg import c\n    import pkg.d\n")
    modules = {name: package / f"{name.split('.')[-1]}.py" for name in ("pkg.a", "pkg.b", "pkg.c", "pkg.d")}
    modules["pkg"] = package / "__init__.py"
    assert import_edges("pkg.a", package / "a.py", modules) == {"pkg.b", "pkg.c", "pkg.d"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and any(graph.values())
    cycles = []
    for component in strongly_connected(graph):
        cycle = " -> ".join(shortest_cycle(graph, component))
        others = sorted(set(component) - set(cycle.split(" -> ")))
        cycles.append(cycle + (f" (with {', '.join(others)} in the same knot)" if others else ""))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# ---- function length -----------------------------------------------------------------------
MAX_FUNCTION_LINES = 90


def test_no_function_longer_than_the_limit():
    long_functions = []
    for package in ("server", "engine", "scheduler"):
        for path in python_files(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    num_lines = node.end_lineno - node.lineno + 1
                    if num_lines > MAX_FUNCTION_LINES:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        long_functions.append(f"{where} {node.name} ({num_lines} lines)")
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


# ---- package cycles and folder sizes ---------------------------------------------------------
def package_of(module: str) -> str:
    """The package a module counts toward: its second-level package (engine.offload for
    engine.offload.slicing.sliced_mlp), or the module itself at the top of a product package
    (engine.config)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in PACKAGES_AT_SECOND_LEVEL else module


PACKAGES_AT_SECOND_LEVEL = {module_name(path.parent / "__init__.py") for package in PRODUCT_PACKAGES
                            for path in (ROOT / package).glob("*/__init__.py")}


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        edges = graph.setdefault(package_of(module), set())
        edges.update(package_of(target) for target in targets)
    for package, edges in graph.items():
        edges.discard(package)
    return graph


def test_package_of_names_second_level_packages():
    assert package_of("engine.offload.slicing.sliced_mlp") == "engine.offload"
    assert package_of("engine.kv") == "engine.kv"
    assert package_of("engine.config") == "engine.config"
    assert package_of("scheduler.planning.fit.search") == "scheduler.planning"


def test_no_package_import_cycles():
    """engine.kv must not import engine.model while engine.model imports engine.kv: a package
    is understood, and could be replaced, below the ones that import it."""
    graph = package_graph()
    cycles = [" -> ".join(shortest_cycle(graph, component)) for component in strongly_connected(graph)]
    assert not cycles, "package import cycles:\n" + "\n".join(cycles)


MAX_MODULES_PER_FOLDER = 14


def test_no_folder_holds_more_than_the_limit():
    crowded = []
    for package in (*PRODUCT_PACKAGES, "benchmarks"):
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            num_modules = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if num_modules > MAX_MODULES_PER_FOLDER:
                crowded.append(f"{folder.relative_to(ROOT)}: {num_modules} modules")
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules:\n" + "\n".join(crowded)


# ---- planning decided once, docs inside the repository ----------------------------------------
def test_the_server_decides_nothing_about_how_the_engine_runs():
    """server/ asks the planning stage (engine/planning/stage.py) and nothing else that plans:
    from the planners it may take constants (flag defaults and choices) and types (errors, the
    plan's values it reports), never a function that decides."""
    for path in python_files("server"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            planning = node.module.startswith(("engine.planning", "scheduler.planning"))
            if planning and node.module != "engine.planning.stage":
                names = [a.name for a in node.names if a.name.islower()]
                assert not names, f"{path.relative_to(ROOT)} imports {names} from {node.module}"


def test_no_module_edits_sys_path():
    for package in (*PRODUCT_PACKAGES, "benchmarks"):
        for path in python_files(package):
            assert "sys.path.insert" not in path.read_text(), path.relative_to(ROOT)



def test_docs_link_nothing_outside_the_repository():
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            resolved = (page.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT), f"{page.name} links {target}, outside the repository"
        assert "../shared" not in page.read_text(), f"{page.name} points at ../shared, outside the repository"
