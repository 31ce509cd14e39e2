"""Sources must not know about sinks; pynvml is imported in one module only."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuwatchd

PKG = Path(gpuwatchd.__file__).parent
FORBIDDEN_IN_SOURCES = (
    "prometheus_client",
    "sqlite3",
    "urllib",
    "http.client",
    "gpuwatchd.sinks",
    "gpuwatchd.health",
)


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_sources_import_no_sink() -> None:
    files = sorted((PKG / "sources").glob("*.py"))
    assert files
    bad = {
        f"{f.name}: {name}"
        for f in files
        for name in imports(f)
        if any(name == x or name.startswith(x + ".") for x in FORBIDDEN_IN_SOURCES)
    }
    assert not bad


def test_pynvml_imported_in_one_module_only() -> None:
    users = sorted(str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if "pynvml" in imports(f))
    assert len(users) == 1, users


def test_public_all_is_sorted_and_complete() -> None:
    for f in PKG.rglob("*.py"):
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
