"""The package's layer matrix, read from the source with `ast`.

worker < core < sources < health < sinks < http < daemon (pipeline/, daemon.py) < cli:
a module imports only from its own layer or below, including imports inside
functions and `importlib.import_module("...")` / `__import__("...")` loads.
Sources know nothing of sinks, SQLite, Prometheus or HTTP clients; pynvml is
imported in one module; nothing outside tests imports test helpers. The diag
worker (gpuwatchd/diag/worker/, a program run in a process of its own) is the
bottom layer: it imports the standard library, the GPU libraries and itself.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuwatchd

PKG = Path(gpuwatchd.__file__).parent
ROOT = PKG.parent

LAYERS = ("worker", "core", "sources", "health", "sinks", "http", "daemon", "cli")
# Top-level names that are not core; everything else directly under gpuwatchd/ is core.
LAYER_OF_TOP = {
    "sources": "sources",
    "health": "health",
    "sinks": "sinks",
    "http": "http",
    "app": "daemon",
    "pipeline": "daemon",
    "forensics": "daemon",
    "hangs": "daemon",  # the hang monitor's threads, store writes and route (health: decisions)
    "preflight": "daemon",
    "diag": "daemon",
    "daemon": "daemon",
    "cli": "cli",
    "__main__": "cli",
}
FORBIDDEN_IN_SOURCES = (
    "prometheus_client",
    "sqlite3",
    "urllib",
    "http.client",
    "gpuwatchd.sinks",
    "gpuwatchd.health",
)
# The daemon serves HTTP on its own event loop (http/server.py), hardened against slow
# clients; the stdlib servers and prometheus_client's (a thread per connection) are not
# used, though prometheus_client's exposition module imports them.
FORBIDDEN_IN_PACKAGE = (
    "http.server",
    "wsgiref",
    "socketserver",
    "prometheus_client.exposition.start_http_server",
    "prometheus_client.exposition.start_wsgi_server",
    "prometheus_client.exposition.make_wsgi_app",
    "prometheus_client.exposition.MetricsHandler",
    "prometheus_client.start_http_server",
    "prometheus_client.start_wsgi_server",
    "prometheus_client.make_wsgi_app",
    "prometheus_client.MetricsHandler",
)
# prometheus_client renders the exposition: the metrics sink, the HTTP layer, the daemon.
PROMETHEUS_CLIENT_USERS = ("gpuwatchd.sinks.prometheus", "gpuwatchd.http", "gpuwatchd.daemon")
MAX_LINES = 500
# Temporary exceptions while a module is being split (none now); drop an entry once it fits.
OVERSIZE_ALLOWED: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


# Packages whose layer differs from their top-level name's (the longest prefix wins).
LAYER_OF_PACKAGE = {"gpuwatchd.diag.worker": "worker"}
# What the worker may import besides the standard library and itself: the GPU libraries.
WORKER_THIRD_PARTY = ("cupy", "numpy", "torch")


def layer_of(module: str) -> str:
    for package, layer in LAYER_OF_PACKAGE.items():
        if module == package or module.startswith(package + "."):
            return layer
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    return LAYER_OF_TOP.get(parts[1], "core")


def _string_constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string or a tuple/list of strings."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        target: ast.expr | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        value = getattr(node, "value", None)
        if not isinstance(target, ast.Name) or value is None:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out[target.id] = [value.value]
        elif isinstance(value, (ast.Tuple, ast.List)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            out[target.id] = [e.value for e in value.elts]  # type: ignore[attr-defined]
    return out


def _loop_bindings(tree: ast.Module, constants: dict[str, list[str]]) -> dict[str, list[str]]:
    """`for name in CONSTANT:` loops, so `import_module(name)` resolves to CONSTANT."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, ast.Name)
            and node.iter.id in constants
        ):
            out.setdefault(node.target.id, []).extend(constants[node.iter.id])
    return out


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" or func.attr == "__import__"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def imports_of(source: str, module: str = "") -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import anywhere in `source`.

    Relative imports are resolved against `module`. A dynamic import whose
    argument the test cannot resolve to a string yields "<unresolved>".
    """
    tree = ast.parse(source)
    constants = _string_constants(tree)
    loops = _loop_bindings(tree, constants)
    package = module.split(".") if source_is_package(module) else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:  # `from gpuwatchd import daemon` names a module too
                yield node.lineno, f"{name}.{alias.name}"
        elif isinstance(node, ast.Call) and _is_dynamic_import(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value
            elif isinstance(arg, ast.Name) and (arg.id in loops or arg.id in constants):
                for name in loops.get(arg.id) or constants[arg.id]:
                    yield node.lineno, name
            else:
                yield node.lineno, "<unresolved>"


def source_is_package(module: str) -> bool:
    return (ROOT / Path(*module.split(".")) / "__init__.py").exists()


def package_files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _gpuwatchd_module(name: str) -> str | None:
    """The deepest existing gpuwatchd module that `name` refers to, else None."""
    if name != "gpuwatchd" and not name.startswith("gpuwatchd."):
        return None
    parts = name.split(".")
    while parts:
        path = ROOT / Path(*parts)
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return None


def layer_violations(module: str, source: str) -> list[str]:
    """Imports in `source` (the text of `module`) that reach a higher layer."""
    own = LAYERS.index(layer_of(module))
    bad = []
    for line, name in imports_of(source, module):
        if name == "<unresolved>":
            bad.append(f"{module}:{line}: dynamic import of a name the test cannot resolve")
            continue
        if name == "tests" or name.startswith("tests."):
            bad.append(f"{module}:{line}: imports test helpers ({name})")
            continue
        target = _gpuwatchd_module(name)
        if target is not None and LAYERS.index(layer_of(target)) > own:
            bad.append(f"{module}:{line}: {layer_of(module)} imports {layer_of(target)} ({name})")
    return bad


def test_health_imports_nothing_from_sources() -> None:
    # Decisions are made on values; reading the node is a source's job (issue 9).
    files = [f for f in package_files() if module_name(f).startswith("gpuwatchd.health")]
    assert files
    bad = [
        f"{module_name(f)}:{line}: {name}"
        for f in files
        for line, name in imports_of(f.read_text(), module_name(f))
        if name == "gpuwatchd.sources" or name.startswith("gpuwatchd.sources.")
    ]
    assert not bad, "\n".join(bad)


def test_layer_matrix() -> None:
    files = package_files()
    assert len(files) > 50
    bad = [v for f in files for v in layer_violations(module_name(f), f.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("gpuwatchd.sources.shm.source", "from gpuwatchd.health import rules\n"),
        ("gpuwatchd.health.rules", "def f():\n    from gpuwatchd.sinks import store\n"),
        ("gpuwatchd.sinks.store", "import importlib\nimportlib.import_module('gpuwatchd.http')\n"),
        ("gpuwatchd.http.server", "__import__('gpuwatchd.pipeline')\n"),
        ("gpuwatchd.pipeline", "from gpuwatchd import cli\n"),
        ("gpuwatchd.model", "from gpuwatchd.sources import registry\n"),
        ("gpuwatchd.state", "from tests.servers import LoopbackServer\n"),
        (
            "gpuwatchd.daemon",
            "import importlib\nM = ('gpuwatchd.cli.run',)\n"
            "for m in M:\n    importlib.import_module(m)\n",
        ),
        ("gpuwatchd.sinks.store", "import importlib\nimportlib.import_module(f'x{1}')\n"),
    ],
)
def test_layer_checker_catches(module: str, source: str) -> None:
    assert layer_violations(module, source)


def test_diag_worker_imports_only_the_standard_library_gpu_libraries_and_itself() -> None:
    """The worker runs under whatever interpreter has CuPy or PyTorch (diag.python),
    which may lack gpuwatchd's own dependencies: nothing of the daemon may load there."""
    files = sorted((PKG / "diag" / "worker").rglob("*.py"))
    assert len(files) >= 4
    files += [PKG / "__init__.py", PKG / "diag" / "__init__.py"]  # loaded on the way in
    bad = [
        f"{module_name(f)}:{line}: {name}"
        for f in files
        for line, name in imports_of(f.read_text(), module_name(f))
        if not worker_may_import(name)
    ]
    assert not bad, bad


def worker_may_import(name: str) -> bool:
    top = name.split(".")[0]
    if top == "gpuwatchd":
        return name in ("gpuwatchd", "gpuwatchd.diag") or layer_of(name) == "worker"
    return top in sys.stdlib_module_names or top in WORKER_THIRD_PARTY or top == "__future__"


@pytest.mark.parametrize(
    "name", ["gpuwatchd.model", "gpuwatchd.diag.run", "gpuwatchd.logs", "yaml", "pynvml"]
)
def test_worker_checker_catches(name: str) -> None:
    assert not worker_may_import(name)
    if name.startswith("gpuwatchd."):
        assert layer_violations("gpuwatchd.diag.worker.measure", f"import {name}\n")


def test_layer_checker_allows_downward_and_relative() -> None:
    src = (
        "from gpuwatchd.model import Sample\n"
        "from gpuwatchd.sources.nvml import client\n"
        "from . import rules\n"
        "import importlib\nimportlib.import_module('gpuwatchd.sinks.store')\n"
    )
    assert layer_violations("gpuwatchd.sinks.prometheus", src) == []


def test_no_testing_package_and_no_test_imports_outside_tests() -> None:
    assert not (PKG / "testing").exists(), "test helpers live under tests/, not in the package"
    # What ships or runs on a node. benchmarks/ is development tooling, like tests/,
    # and may start the same loopback Prometheus and Alertmanager (tests/servers.py).
    outside = [
        *package_files(),
        *sorted((ROOT / "scripts").glob("*.py")),
        *sorted((ROOT / "deploy").rglob("*.py")),
    ]
    bad = [
        f"{f.relative_to(ROOT)}:{line}: {name}"
        for f in outside
        for line, name in imports_of(f.read_text())
        if name in ("tests", "gpuwatchd.testing")
        or name.startswith(("tests.", "gpuwatchd.testing."))
    ]
    assert not bad, bad


def test_sources_import_no_sink() -> None:
    files = sorted((PKG / "sources").rglob("*.py"))
    assert len(files) > 10
    bad = [
        f"{f.relative_to(PKG)}:{line}: {name}"
        for f in files
        for line, name in imports_of(f.read_text(), module_name(f))
        if any(name == x or name.startswith(x + ".") for x in FORBIDDEN_IN_SOURCES)
    ]
    assert not bad, bad


def test_package_imports_no_stdlib_or_client_library_http_server() -> None:
    bad = [
        f"{f.relative_to(PKG)}:{line}: {name}"
        for f in package_files()
        for line, name in imports_of(f.read_text(), module_name(f))
        if any(name == x or name.startswith(x + ".") for x in FORBIDDEN_IN_PACKAGE)
    ]
    assert not bad, bad


def test_prometheus_client_only_where_the_exposition_is_built() -> None:
    users = {
        module_name(f)
        for f in package_files()
        if any(
            name.split(".")[0] == "prometheus_client"
            for _, name in imports_of(f.read_text(), module_name(f))
        )
    }
    outside = sorted(
        m
        for m in users
        if not any(m == u or m.startswith(u + ".") for u in PROMETHEUS_CLIENT_USERS)
    )
    assert not outside, outside
    assert "gpuwatchd.sinks.prometheus" in users


def test_pynvml_imported_in_one_module_only() -> None:
    users = sorted(
        str(f.relative_to(PKG))
        for f in package_files()
        if any(name == "pynvml" for _, name in imports_of(f.read_text(), module_name(f)))
    )
    assert users == ["sources/nvml/client.py"], users


def test_no_module_over_500_lines() -> None:
    sizes = {str(f.relative_to(PKG)): len(f.read_text().splitlines()) for f in package_files()}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert set(over) <= OVERSIZE_ALLOWED, f"split by responsibility: {over}"
    stale = {name for name in OVERSIZE_ALLOWED if sizes.get(name, 0) <= MAX_LINES}
    assert not stale, f"under {MAX_LINES} lines now: drop from OVERSIZE_ALLOWED: {stale}"


def test_public_all_is_sorted_and_complete() -> None:
    for f in package_files():
        tree = ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names = ast.literal_eval(node.value)
                assert list(names) == sorted(names), f"{f}: __all__ not sorted"
                defined = (
                    {
                        n.name
                        for n in tree.body
                        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                    }
                    | {
                        t.id
                        for n in tree.body
                        if isinstance(n, (ast.Assign, ast.AnnAssign))
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        if isinstance(t, ast.Name)
                    }
                    | {
                        (a.asname or a.name).split(".")[0]
                        for n in tree.body
                        if isinstance(n, (ast.Import, ast.ImportFrom))
                        for a in n.names
                    }
                )
                missing = set(names) - defined
                assert not missing, f"{f}: __all__ names undefined {missing}"


def _reads_status_by_key(tree: ast.Module) -> list[int]:
    """Lines that read a `status` mapping by key: `x.status[...]`, `x.status.get(...)`,
    `x.status()[...]`, `x.status().get(...)`."""
    found = []
    for node in ast.walk(tree):
        target: ast.expr | None = None
        if isinstance(node, ast.Subscript):
            target = node.value
        elif isinstance(node, ast.Attribute) and node.attr == "get":
            target = node.value
        if isinstance(target, ast.Call):
            target = target.func
        if isinstance(target, ast.Attribute) and target.attr == "status":
            found.append(node.lineno)
    return found


def test_nothing_outside_a_source_reads_its_status_by_key() -> None:
    """Sources hand other layers typed payloads; `status()` is /status's JSON only."""
    offenders = {
        str(f.relative_to(PKG)): lines
        for f in package_files()
        if f.relative_to(PKG).parts[0] != "sources"
        and (lines := _reads_status_by_key(ast.parse(f.read_text())))
    }
    assert not offenders, f"read the source's typed payload instead: {offenders}"


def test_every_exception_class_is_in_the_errors_tree() -> None:
    """errors.py's docstring draws the whole hierarchy; a new exception class joins it."""
    from gpuwatchd import errors

    def is_exception(base: ast.expr) -> bool:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        return name.endswith(("Error", "Errors", "Exception", "Timeout"))

    defined = {
        f"{f.relative_to(PKG)}:{node.name}"
        for f in package_files()
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.ClassDef) and any(is_exception(b) for b in node.bases)
    }
    missing = {d for d in defined if d.rsplit(":", 1)[1] not in (errors.__doc__ or "")}
    assert not missing, f"add to the tree in gpuwatchd/errors.py: {missing}"
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.GpuwatchdError), name


def import_graph() -> dict[str, set[str]]:
    """gpuwatchd module -> the gpuwatchd modules it imports (anywhere in it, as above)."""
    graph: dict[str, set[str]] = {}
    for f in package_files():
        module = module_name(f)
        targets = {_gpuwatchd_module(name) for _, name in imports_of(f.read_text(), module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


# Reviewed cycles: a package whose __init__ loads its children by name while they
# import a helper from it; drop an entry once its loop is gone.
CYCLES_ALLOWED: set[tuple[str, ...]] = set()  # reviewed exceptions, each with its reason


def test_no_import_cycles() -> None:
    """No two gpuwatchd modules import each other, directly or around a loop: imports in
    functions and under TYPE_CHECKING count (a cycle there is one refactor from a crash)."""
    cycles = {tuple(c) for c in import_cycles(import_graph())}
    new = cycles - CYCLES_ALLOWED
    assert not new, "\n".join(" -> ".join(c) for c in sorted(new))
    stale = CYCLES_ALLOWED - cycles
    assert not stale, f"gone now: drop from CYCLES_ALLOWED: {stale}"


def test_cycle_checker_catches() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
