"""The layering of docs/architecture.md, kept: no module imports from a floor above its own, lazily or not,
and no import circle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"uhop_onnx": "uhop_onnx", "partitioner": "uhop_onnx.partitioner", "providers": "uhop_onnx.providers",
            "custom_ops": "uhop_onnx.custom_ops", "models": "uhop_onnx.models"}

# Module name prefixes -> floor (the longest prefix that matches decides), from the ground up.
FLOORS = {
    "uhop_onnx": 1, "uhop_onnx.foundation": 1, "uhop_onnx.precision": 1, "uhop_onnx.models": 1,
    "uhop_onnx.model": 2, "uhop_onnx.partitioner.extract": 2,
    "uhop_onnx.providers": 3, "uhop_onnx.custom_ops": 3, "uhop_onnx.products.targets": 3,
    "uhop_onnx.runtime": 4, "uhop_onnx.bundle": 4, "uhop_onnx.adaptation": 4,
    "uhop_onnx.partitioner": 5,
    "uhop_onnx.products": 6, "uhop_onnx.serve": 6, "uhop_onnx.backend": 6,
    "uhop_onnx.cli": 7, "uhop_onnx.serve.cli": 7, "uhop_onnx.exec": 7, "uhop_onnx.command": 7,
    "uhop_onnx.providers.rknn.cli": 7,
    "uhop_onnx.products.bench": 7, "uhop_onnx.products.kernels_bench": 7,
}
NAMES = {1: "foundation", 2: "model", 3: "providers", 4: "runtime", 5: "placement", 6: "products", 7: "faces"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def imports(module: str) -> set[str]:
    """The project's modules `module` imports anywhere in its text (inside functions too), but for a type
    checker only."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _type_checking(block.test)
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports only a type checker reads."""
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


GRAPH = {module: imports(module) for module in MODULES}


def test_every_module_has_a_floor():
    assert all(floor(m) in NAMES for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_floor_above_its_own(module):
    upward = sorted(f"{dep} ({NAMES[floor(dep)]})" for dep in GRAPH[module] if floor(dep) > floor(module))
    assert not upward, f"{module} ({NAMES[floor(module)]}) imports upward: {', '.join(upward)}"


def test_no_import_circle():
    """Tarjan's strongly connected components over the import graph: every one is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for dep in GRAPH[m]:
            if dep not in index:
                visit(dep)
                low[m] = min(low[m], low[dep])
            elif dep in stack:
                low[m] = min(low[m], index[dep])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_scan_sees_lazy_and_relative_imports():
    assert "uhop_onnx.runtime.executor" in GRAPH["uhop_onnx.products.session"]
    assert "uhop_onnx.providers.base" in GRAPH["uhop_onnx.providers"]
    assert "uhop_onnx.foundation.errors" in GRAPH["uhop_onnx.partitioner.extract"]


@pytest.mark.parametrize("package", sorted({p.parent for p in (ROOT / "uhop_onnx").rglob("__init__.py")}))
def test_no_package_holds_more_than_fifteen_modules_and_each_floor_says_what_it_may_import(package):
    modules = [p for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= 15, f"{package.relative_to(ROOT)} holds {len(modules)} modules at its top"
    if package.parent == ROOT / "uhop_onnx" and package.name in ("foundation", "model", "runtime", "adaptation",
                                                                 "products"):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert "Import" in doc, f"{package.name}'s docstring says nothing of what it may import"
