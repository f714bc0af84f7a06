"""Which global names a written function uses, and which a patched upstream module binds: the
mechanical half of "one source" (hook and patch must see the same objects)."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import symtable
from collections.abc import Iterable, Sequence

import libcst as cst

from sglang_dsv4.fix import Fix
from sglang_dsv4.maintain.upstream import ExportError

MODULE_DUNDERS = {"__name__", "__file__", "__doc__", "__spec__", "__package__", "__loader__"}




# --- names --------------------------------------------------------------------------------------


def used_globals(source: str, name: str, future_annotations: bool) -> tuple[set[str], set[str]]:
    """Global names the def `name` in `source` uses: (when the def statement runs: decorators,
    defaults, annotations unless postponed; when the function runs)."""
    prefix = "from __future__ import annotations\n" if future_annotations else ""
    top = symtable.symtable(prefix + source, "<written>", "exec")
    at_def = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    at_call: set[str] = set()
    for child in top.get_children():
        # lambdas and comprehensions beside the def's own scope sit in its defaults: def time
        _globals_of(child, at_call if child.get_name() == name else at_def)
    return at_def - {"annotations"}, at_call


def _globals_of(table: symtable.SymbolTable, out: set[str]) -> None:
    for sym in table.get_symbols():
        if sym.is_global() and sym.is_referenced():
            out.add(sym.get_name())
    for child in table.get_children():
        _globals_of(child, out)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def bound_names(statements: Iterable[ast.stmt]) -> set[str]:
    """Names a block of statements binds at runtime (`if TYPE_CHECKING:` bodies excluded)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            names |= bound_names(node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    names |= bound_names([child])
                elif isinstance(child, ast.excepthandler):
                    names |= ({child.name} if child.name else set()) | bound_names(child.body)
                else:
                    names |= _stored_names(child)
    return names


def _stored_names(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return set()
    found = {node.id} if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else set()
    for child in ast.iter_child_nodes(node):
        found |= _stored_names(child)
    return found


def only_imports(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
    )


def has_future_annotations(module: cst.Module) -> bool:
    return any(
        isinstance(small, cst.ImportFrom)
        and isinstance(small.module, cst.Name)
        and small.module.value == "__future__"
        and not isinstance(small.names, cst.ImportStar)
        and any(alias.name.value == "annotations" for alias in small.names)
        for statement in module.body
        if only_imports(statement)
        for small in statement.body
    )


def find_ast_def(module: ast.Module, class_path: Sequence[str], name: str):
    statements = module.body
    cls = None
    for class_name in class_path:
        cls = next(n for n in statements if isinstance(n, ast.ClassDef) and n.name == class_name)
        statements = cls.body
    node = next(
        n
        for n in statements
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )
    return cls, node


def check_names(w, patched: ast.Module, future: bool, tree) -> None:
    """Every global `w` uses resolves in the patched module, and to the object the fix module
    binds at runtime (where the hook runs the same function). `w` is an export.Written, `tree`
    the export.Tree being patched."""
    at_def, at_call = used_globals(w.source, w.func.__name__, future)
    module_names = bound_names(patched.body) | MODULE_DUNDERS
    class_names: set[str] = set()
    if w.in_class:
        cls, _ = find_ast_def(patched, w.class_path, w.name)
        class_names = bound_names(cls.body)
    for name in sorted(at_def | at_call):
        visible = module_names | (class_names if name in at_def else set())
        if name not in visible and not hasattr(builtins, name):
            raise ExportError(
                f"{w.label}: name {name} does not resolve in {w.module} after the patch "
                "(not defined or imported there, not added by the series, not a builtin)"
            )
    runtime = w.func.__globals__
    try:
        upstream = importlib.import_module(w.module)
    except ImportError as exc:
        raise ExportError(
            f"{w.label}: cannot import {w.module} to compare bindings ({exc})"
        ) from None
    for name in sorted(at_call | (at_def - class_names) - MODULE_DUNDERS):
        if (w.module, name) in tree.bindings:
            expected = tree.bindings[(w.module, name)]
        elif name in module_names and hasattr(upstream, name):
            expected = getattr(upstream, name)
        elif name in module_names:
            raise ExportError(
                f"{w.label}: name {name} is bound in {w.module}'s source but not on the "
                "imported module; cannot check that hook and patch agree on it"
            )
        else:
            expected = getattr(builtins, name)
        actual = runtime.get(name, getattr(builtins, name, None))
        if name not in runtime and not hasattr(builtins, name):
            raise ExportError(
                f"{w.label}: name {name} is not bound in {w.func.__module__}, "
                "so the runtime hook would raise NameError; import it there"
            )
        if _plain(actual) is not _plain(expected):
            raise ExportError(
                f"{w.label}: name {name} is a different object in {w.func.__module__} than in "
                f"{w.module} after the patch; import it from there (one source for hook and patch)"
            )


def _plain(obj):
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def declared_bindings(fix: Fix, module: str, tree) -> dict[str, object]:
    """The objects the fix's declared import lines for `module` bind, as written (before any
    carried-module rewrite); names the series adds to a module come from the series."""
    bound: dict[str, object] = {}
    for line in fix.imports.get(module, ()):
        where = f"fix {fix.id}: import {line!r} for {module}"
        statement = ast.parse(line).body[0]
        try:
            if isinstance(statement, ast.Import):
                for alias in statement.names:
                    if alias.asname:
                        bound[alias.asname] = importlib.import_module(alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        importlib.import_module(alias.name)
                        bound[top] = importlib.import_module(top)
                continue
            if statement.level:
                raise ExportError(f"{where}: write it as an absolute import")
            source = importlib.import_module(statement.module)
            for alias in statement.names:
                key = (statement.module, alias.name)
                if key in tree.bindings:
                    value = tree.bindings[key]
                elif hasattr(source, alias.name):
                    value = getattr(source, alias.name)
                else:
                    value = importlib.import_module(f"{statement.module}.{alias.name}")
                bound[alias.asname or alias.name] = value
        except ImportError as exc:
            raise ExportError(f"{where}: {exc}") from None
    return bound


