"""The package's layout holds: at most `MAX_TOP_MODULES` modules at the top of the package (the rest live in one
folder per concern), no import circle between its modules (counting imports inside functions, which only hide a
circle, and under `if TYPE_CHECKING:`, which are a circle of the design all the same), and the recipe schema stays
importable without torch (the CLI's refusals are instant)."""

import ast
import subprocess
import sys
from pathlib import Path

import ntl_pretrain

PACKAGE = Path(ntl_pretrain.__file__).parent
MAX_TOP_MODULES = 15


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Every project module that `module` (its source) imports anywhere: at module level, in a function or under
    `if TYPE_CHECKING:`. `from package import name` counts the submodule `name`."""
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` in a package, `from .. import y` one floor up
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
            else:
                base = node.module
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", set(files)) - {name}
        for name, path in files.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_few_modules_at_the_top_of_the_package():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of ntl_pretrain/ (move some to a folder): {top}"
    assert {"__init__.py", "cli.py", "errors.py", "numbers.py", "tokenizer.py"} <= set(top)  # the README's imports


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 80 and "ntl_pretrain.train.trainer" in graph  # the walk found the package
    assert circles(graph) == []


def test_the_detector_sees_a_circle_through_an_import_inside_a_function_or_for_types():
    graph = import_graph()
    hidden = "def formats():\n    from ntl_pretrain.data.config import DataConfig\n"
    seen = imported_modules(hidden, "ntl_pretrain.data.files", False, set(graph))
    assert seen == {"ntl_pretrain.data.config"}
    graph["ntl_pretrain.data.files"] |= seen
    assert any({"ntl_pretrain.data.config", "ntl_pretrain.data.files"} <= set(c) for c in circles(graph))
    annotation_only = "if TYPE_CHECKING:\n    from ntl_pretrain.data.config import DataConfig\n"
    seen = imported_modules(annotation_only, "ntl_pretrain.data.files", False, set(graph))
    assert seen == {"ntl_pretrain.data.config"}


def test_the_recipe_schema_and_the_cli_import_no_torch():
    code = (
        "import sys; import ntl_pretrain.cli, ntl_pretrain.config, ntl_pretrain.config.recipe; "
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
