"""A fingerprint of an installed library function's code, so that code written against that function's behaviour
(train/zero_optimizer.py's replacements inside DeepSpeed) runs only where the function is still the one read.

The fingerprint hashes the function's syntax tree, not its text: comments, docstrings, blank lines, line breaks,
quotes and other layout do not change it, while any change to what the function does (a statement, a name, a
constant, an operator, a decorator) does. This is sound because Python's compiler sees only that tree: two sources
with the same tree compile to the same code. Two exceptions keep it so across Python versions and DeepSpeed's
profiling: the tree is written out field by field with empty fields left out (Python 3.12 added `type_params`,
always empty here, to every function), and DeepSpeed's `instrument_w_nvtx` decorator, a profiler range around the
call, is read through and left out of the tree.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap

UNREADABLE = "unreadable"
PROFILING_DECORATORS = ("instrument_w_nvtx",)


def fingerprint(path: str) -> str:
    """The first 16 hex digits of the sha256 of the syntax tree of the function at `path` (`module.function` or
    `module.Class.function`); `UNREADABLE` when it is not there (moved, renamed) or has no source (installed as
    bytecode only)."""
    try:
        return fingerprint_source(inspect.getsource(unwrapped(_resolve(path))))
    except (ImportError, AttributeError, KeyError, OSError, TypeError, SyntaxError):
        return UNREADABLE


def fingerprint_source(source: str) -> str:
    """The fingerprint of one function's source (indented as in its class or not)."""
    tree = ast.parse(textwrap.dedent(source))
    return hashlib.sha256(_canonical(_without_docstrings(tree)).encode()).hexdigest()[:16]


def _resolve(path: str):
    """The object at `path`: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return target
    raise ImportError(path)


def unwrapped(function):
    """The function a profiling decorator wraps (DeepSpeed's `instrument_w_nvtx` keeps it as the closure's `func`,
    without `functools.wraps`), also under a decorator that keeps it as `__wrapped__` (torch's `_disable_dynamo`, which
    DeepSpeed's `lazy_disable` puts around `instrument_w_nvtx`, copying its name)."""
    function = inspect.unwrap(function)
    while getattr(function, "__name__", None) == "wrapped_fn":
        function = inspect.unwrap(inspect.getclosurevars(function).nonlocals["func"])
    return function


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node.decorator_list = [decorator for decorator in node.decorator_list if not _profiling(decorator)]
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            if _is_docstring(node.body[0]):
                node.body = node.body[1:]
    return tree


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(getattr(statement.value, "value", None), str)


def _profiling(decorator: ast.expr) -> bool:
    name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", None)
    return name in PROFILING_DECORATORS


def _canonical(node) -> str:
    """The tree as text: node types and their non-empty fields by name (line numbers are attributes, not fields)."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node) if not _empty(value)]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(_canonical(item) for item in node)}]"
    return repr(node)


def _empty(value) -> bool:
    return value is None or (isinstance(value, list) and not value)
