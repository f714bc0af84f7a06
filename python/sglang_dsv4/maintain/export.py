"""`sglang-dsv4 export-patches`: every carried change as a git patch against the pinned upstream.

The patches are generated from the register alone (`sglang_dsv4.fix`), from the very function
objects the plugin installs, so the two deliveries cannot drift apart:

- `Replace(target, func)`: the source of `func` (`inspect.getsource`) takes the place of the
  original definition in upstream's file, renamed to the target's name and indented into its class
  by libcst (strings untouched; ruff re-indents docstrings). Our decorators are kept; a `staticmethod` / `classmethod` of the original is
  restored, as upstream's HookRegistry restores it at runtime. Other decorators of the original are
  dropped (the runtime hook drops them too), with a note on stderr.
- `Add(owner, func)`: inserted under its own name, at the end of the class body, or at module level
  after the last top-level statement that binds a name it uses (at the end when none does).
- `Fix.imports`: the declared import lines go after the module's existing imports.
- `Fix.new_files`: whole modules of the distribution (the kernels of `sgl_kernel_dsv4`) copied into
  upstream's tree under the declared upstream module name, so the patched tree is self-contained.
  Imports of carried modules, in those files and in the declared import lines, are rewritten to
  their upstream names; importing a distribution module that is not carried is an error.

One source is enforced mechanically. Every global name a written function uses must be bound in the
patched upstream module (its top-level definitions and imports outside `if TYPE_CHECKING:`, what
the series adds there, builtins), and the fix module must bind the same object (the function's
globals at runtime are the fix module's): imported from that upstream module, from a declared
import, or the added function itself. Zero-argument `super()` and name-mangled `__names` are
refused in methods, as they behave differently inside and outside a class body. The file a function
is read from is compiled again and must give the bytecode the process imported (the hook runs that).

Formatting: upstream formats with black and isort (profile black, line length 88); ruff (pinned,
black-compatible) stands in for both. Upstream's files the series touches are already formatted as
ruff formats them (checked per file, each time), so the patched file is formatted whole and only
what the series wrote changes; a file that is not gets each written def formatted alone
(`ruff format --range`), so the rest never shows in a diff. Imports are sorted by ruff's isort
rules when the file was isort-clean before the change. New files are formatted whole.

Patches are `git format-patch` output from a scratch repository holding the pristine files the
series touches: zero commit id, a fixed author and date, full blob ids, no signature, global git
configuration ignored, so exporting twice gives identical bytes. The body carries the register's
Why / How and DEP-3 fields. Without `--upstream-src`, upstream's source is the pinned wheel
(`pip download --no-deps sglang==PIN`, which holds the Python sources), unpacked once into
`$XDG_CACHE_HOME/sglang-dsv4/` (default `~/.cache/sglang-dsv4/`) as upstream's repository lays it
out (`python/sglang/...`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from sglang_dsv4 import UPSTREAM_PIN
from sglang_dsv4.fix import Fix
from sglang_dsv4.maintain.formatting import format_file, format_written, sort_imports
from sglang_dsv4.maintain.names import (
    bound_names,
    check_names,
    declared_bindings,
    has_future_annotations,
    only_imports,
    used_globals,
)
from sglang_dsv4.maintain.upstream import (
    AUTHOR_NAME,
    ExportError,
    git,
    init_repo,
    upstream_python_dir,
)

LAST_UPDATE = "2026-12-01"
# Packages of this distribution: upstream's tree cannot import them, only carry them (new_files).
DISTRIBUTION_PACKAGES = ("sglang_dsv4", "sgl_kernel_dsv4")


# --- the functions a fix writes -----------------------------------------------------------------


@dataclass
class Written:
    """One function of a fix, as it will stand in upstream's file."""

    fix: Fix
    registered: object  # what the register names (a function, or a decorated one)
    func: Callable  # the plain function inside it: its source and globals
    node: cst.FunctionDef  # parsed from its source, not yet renamed
    source: str
    module: str  # upstream module it goes into
    class_path: tuple[str, ...]  # enclosing classes there, outermost first
    name: str  # its name there
    label: str  # for messages: "fix X: target T (function f)"
    replaces: bool  # True: takes the place of upstream's definition; False: added
    takes_routes: object = None  # fix.Routes of an added function serving an endpoint

    @property
    def in_class(self) -> bool:
        return bool(self.class_path)


def _read_function(func, fix: Fix, target: str) -> tuple[Callable, cst.FunctionDef, str]:
    """(plain function, its def as libcst node, source text that parses on its own)."""
    # the function under staticmethod / classmethod and functools.wraps-style decorators
    # (lru_cache, ...); its source carries those decorators
    plain = inspect.unwrap(func.__func__ if isinstance(func, (staticmethod, classmethod)) else func)
    where = f"fix {fix.id}: target {target}"
    if not inspect.isfunction(plain):
        raise ExportError(f"{where}: {func!r} is not a Python function")
    try:
        source = inspect.getsource(plain)
    except (OSError, TypeError) as exc:
        raise ExportError(
            f"{where}: cannot read the source of {plain.__qualname__} ({exc})"
        ) from None
    # An indented def (a method in the fix module) parses under `if True:`, which keeps its
    # multi-line strings as they are; libcst re-indents the statements where the def goes.
    indented = source[:1].isspace()
    if indented:
        source = "if True:\n" + source
    body = cst.parse_module(source).body
    if indented:
        body = body[0].body.body
    if len(body) != 1 or not isinstance(body[0], cst.FunctionDef):
        raise ExportError(f"{where}: {plain.__qualname__} is not a plain `def` (a lambda?)")
    # The patch is written from the file, the hook runs the imported code: they must be one.
    if not _matches_file(plain.__code__):
        raise ExportError(
            f"{where}: {plain.__code__.co_filename} no longer holds the {plain.__qualname__} this "
            "process imported (edited since?); run the export again"
        )
    return plain, body[0], source


def _matches_file(code) -> bool:
    """Whether compiling `code`'s file now gives `code` again (same place, same bytecode)."""
    try:
        compiled = _compile_file(code.co_filename, Path(code.co_filename).read_text())
    except (OSError, SyntaxError):
        return False
    pending = [compiled]
    while pending:
        candidate = pending.pop()
        if (candidate.co_qualname, candidate.co_firstlineno) == (
            code.co_qualname,
            code.co_firstlineno,
        ):
            return _same_code(candidate, code)
        pending.extend(c for c in candidate.co_consts if inspect.iscode(c))
    return False


@functools.lru_cache(maxsize=16)
def _compile_file(filename: str, text: str):
    return compile(text, filename, "exec", dont_inherit=True)


def _same_code(a, b) -> bool:
    """Same bytecode, names and constants (line numbers aside)."""
    fields = ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or len(a.co_consts) != len(b.co_consts):
        return False
    return all(
        _same_code(x, y)
        if inspect.iscode(x) and inspect.iscode(y)
        else type(x) is type(y) and x == y
        for x, y in zip(a.co_consts, b.co_consts, strict=True)
    )


def _check_class_safe(written: Written) -> None:
    """Refuse what behaves differently inside a class body (patch) and outside it (hook)."""
    for node in ast.walk(ast.parse(written.source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "super" and not node.args:
                raise ExportError(
                    f"{written.label}: zero-argument super() only works inside a class body; "
                    "write super(Class, self)"
                )
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
            raise ExportError(
                f"{written.label}: {name} is name-mangled inside a class body but not in the "
                "runtime hook; use a single underscore"
            )


# --- the tree being patched ---------------------------------------------------------------------


@dataclass
class Tree:
    """Upstream's files as the series so far leaves them (repository paths, `python/...`)."""

    python_dir: Path
    texts: dict[str, str] = field(default_factory=dict)
    # (module, name) -> object, for the names the series so far binds in upstream modules (added
    # functions, declared imports): what the fix module must bind to the same object
    bindings: dict[tuple[str, str], object] = field(default_factory=dict)
    # carried distribution module -> its upstream module name (Fix.new_files, inverted)
    carried: dict[str, str] = field(default_factory=dict)

    def module_file(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for path in (f"python/{rel}.py", f"python/{rel}/__init__.py"):
            if path in self.texts or (self.python_dir / path.removeprefix("python/")).is_file():
                return path
        return None

    def text(self, path: str) -> str:
        if path not in self.texts:
            self.texts[path] = (self.python_dir / path.removeprefix("python/")).read_text()
        return self.texts[path]

    def split(self, dotted: str, where: str) -> tuple[str, str, tuple[str, ...]]:
        """(module, repository path, names inside it) for a dotted upstream path."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            path = self.module_file(module)
            if path:
                return module, path, tuple(parts[cut:])
        raise ExportError(f"{where}: no module of it exists in the upstream tree {self.python_dir}")


# --- editing one module with libcst -------------------------------------------------------------


def _blank() -> cst.EmptyLine:
    return cst.EmptyLine(indent=False)


def _def_index(statements: Sequence[cst.BaseStatement], kind, name: str, where: str, path: str):
    found = [i for i, s in enumerate(statements) if isinstance(s, kind) and s.name.value == name]
    if not found:
        return None
    if len(found) > 1:
        raise ExportError(f"{where}: {name} is defined {len(found)} times in {path}")
    return found[0]


def _in_class(statements, class_path, edit, where: str, path: str) -> list:
    """Apply `edit` to the statement list of the class at `class_path` (the module when empty)."""
    statements = list(statements)
    if not class_path:
        return edit(statements)
    index = _def_index(statements, cst.ClassDef, class_path[0], where, path)
    if index is None:
        raise ExportError(f"{where}: class {class_path[0]} not found in {path}")
    cls = statements[index]
    if not isinstance(cls.body, cst.IndentedBlock):
        raise ExportError(f"{where}: class {class_path[0]} in {path} has a one-line body")
    inner = _in_class(cls.body.body, class_path[1:], edit, where, path)
    statements[index] = cls.with_changes(body=cls.body.with_changes(body=inner))
    return statements


def _decorator_name(decorator: cst.Decorator) -> str:
    return cst.Module(body=[]).code_for_node(decorator.decorator)


def _replacement(written: Written, original: cst.FunctionDef, path: str) -> cst.FunctionDef:
    kinds = {"staticmethod", "classmethod"}
    ours = [_decorator_name(d) for d in written.node.decorators]
    theirs = [_decorator_name(d) for d in original.decorators]
    if kinds & set(ours):
        raise ExportError(
            f"{written.label}: decorate the replacement as a plain function; the original's "
            "staticmethod / classmethod is restored from upstream"
        )
    decorators = list(written.node.decorators)
    for name in theirs:
        if name.endswith(("property", ".setter", ".getter", ".deleter")):
            raise ExportError(f"{written.label}: the original in {path} is a property (@{name})")
        if name in kinds:
            decorators.insert(0, cst.Decorator(decorator=cst.Name(name)))
        elif name not in ours:
            print(
                f"sglang-dsv4 export-patches: note: {written.label}: upstream's @{name} is "
                "dropped, as the runtime hook drops it",
                file=sys.stderr,
            )
    return written.node.with_changes(
        name=cst.Name(written.name), decorators=decorators, leading_lines=original.leading_lines
    )


def _statement_binds(statement: cst.BaseStatement) -> set[str]:
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return {statement.name.value}  # the common case, without generating its code
    if isinstance(statement, cst.SimpleStatementLine):
        code = "\n".join(cst.Module(body=[]).code_for_node(small) for small in statement.body)
    else:
        code = cst.Module(body=[statement]).code
    return bound_names(ast.parse(code).body)


def _insert_module_level(statements: list, written: Written, needs: set[str]) -> list:
    """After the last top-level statement binding a name the function uses, else at the end."""
    depends = [
        i for i, s in enumerate(statements) if not only_imports(s) and _statement_binds(s) & needs
    ]
    if depends:
        position = depends[-1] + 1
    else:
        position = len(statements) - (bool(statements) and _is_main_guard(statements[-1]))
    node = written.node.with_changes(leading_lines=[_blank(), _blank()])
    statements.insert(position, node)
    if position + 1 < len(statements):
        following = statements[position + 1]
        lines = list(following.leading_lines)
        blanks = 0
        while blanks < len(lines) and lines[blanks].comment is None:
            blanks += 1
        if blanks < 2:
            lines = [_blank()] * (2 - blanks) + lines
        statements[position + 1] = following.with_changes(leading_lines=lines)
    return statements


def _is_main_guard(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.If) and "__main__" in cst.Module(body=[]).code_for_node(
        statement.test
    )


def _insert_imports(statements: list, lines: Sequence[cst.SimpleStatementLine]) -> list:
    """After the last import of the module's leading block, skipping those already there."""
    code_of = cst.Module(body=[]).code_for_node
    have = {code_of(small) for s in statements if only_imports(s) for small in s.body}
    position = 0
    for i, statement in enumerate(statements):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            break
        if only_imports(statement) or (i == 0 and _is_docstring(statement)):
            position = i + 1
    for line in lines:
        code = code_of(line.body[0])
        if code not in have:
            statements.insert(position, line.with_changes(leading_lines=[]))
            have.add(code)
            position += 1
    return statements


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and isinstance(statement.body[0], cst.Expr)
        and isinstance(statement.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


# --- carried distribution modules ---------------------------------------------------------------


class _CarriedImports(cst.CSTTransformer):
    """Rewrites imports of carried distribution modules to their upstream names."""

    def __init__(self, carried: dict[str, str], package: str | None, where: str):
        self.carried, self.package, self.where = carried, package, where

    def _upstream_name(self, module: str) -> str:
        if module in self.carried:
            return self.carried[module]
        if module.split(".")[0] in DISTRIBUTION_PACKAGES:
            raise ExportError(
                f"{self.where}: imports {module}, which upstream's tree lacks; "
                "carry it with Fix.new_files"
            )
        return module

    def leave_ImportFrom(self, original, updated):
        dots = len(updated.relative)
        name = cst.Module(body=[]).code_for_node(updated.module) if updated.module else ""
        if dots:
            if not self.package:
                raise ExportError(f"{self.where}: relative import outside a carried module")
            name = importlib.util.resolve_name("." * dots + name, self.package)
        new = self._upstream_name(name)
        if new == name and not dots:
            return updated
        return updated.with_changes(relative=[], module=cst.parse_expression(new))

    def leave_Import(self, original, updated):
        names = []
        for alias in updated.names:
            name = cst.Module(body=[]).code_for_node(alias.name)
            new = self._upstream_name(name)
            if new != name and alias.asname is None:
                raise ExportError(f"{self.where}: write `import {name} as ...` to carry it")
            names.append(alias.with_changes(name=cst.parse_expression(new)))
        return updated.with_changes(names=names)


def _rewrite_imports(code: str, carried: dict[str, str], package: str | None, where: str) -> str:
    return cst.parse_module(code).visit(_CarriedImports(carried, package, where)).code


def _carry_new_files(fix: Fix, tree: Tree, pristine: Path) -> list[str]:
    written = []
    for module, source_module in fix.new_files.items():
        tree.carried[source_module] = module
    for module, source_module in fix.new_files.items():
        where = f"fix {fix.id}: new file {module}"
        path = "python/" + module.replace(".", "/") + ".py"
        if not module.startswith("sglang."):
            raise ExportError(f"{where}: new files go under sglang.")
        if (pristine / path.removeprefix("python/")).exists():
            raise ExportError(f"{where}: upstream already has {path}")
        if not (pristine / path.removeprefix("python/")).parent.is_dir():
            raise ExportError(f"{where}: upstream has no package for {path}")
        spec = importlib.util.find_spec(source_module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ExportError(
                f"{where}: {source_module} is not a Python module of the distribution"
            )
        package = (
            source_module if spec.submodule_search_locations else source_module.rpartition(".")[0]
        )
        code = _rewrite_imports(Path(spec.origin).read_text(), tree.carried, package, where)
        tree.texts[path] = format_file(code, pristine)
        written.append(path)
    return written


# --- one fix ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    fix: Fix
    # File names in the series: the new files (kernels) first when the fix carries any, as an
    # upstream reviewer takes a kernel and its integration as two changes; then the integration.
    patches: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def patch(self) -> str | None:
        """The integration patch (the fix's functions), or None when the fix exports nothing."""
        return self.patches[-1] if self.patches else None


def _written_functions(fix: Fix, tree: Tree) -> list[Written]:
    result = []
    # (function, target, replaces an original, routes it takes): replacements, then additions.
    jobs = [(r.func, r.target, True, None) for r in fix.replaces]
    jobs += [(a.func, a.target, False, a.takes_routes) for a in fix.adds]
    for hooked, target, replaces, takes_routes in jobs:
        where = f"fix {fix.id}: target {target}"
        module, _, names = tree.split(target, where)
        func, node, source = _read_function(hooked, fix, target)
        label = f"{where} (function {func.__name__})"
        result.append(
            Written(
                fix, hooked, func, node, source, module, names[:-1], names[-1], label, replaces,
                takes_routes=takes_routes,
            )
        )
    return result


def _import_statements(fix: Fix, module: str, tree: Tree) -> list[cst.SimpleStatementLine]:
    statements = []
    for line in fix.imports[module]:
        where = f"fix {fix.id}: import {line!r} for {module}"
        try:
            statement = cst.parse_statement(line)
        except cst.ParserSyntaxError:
            raise ExportError(f"{where}: not one Python import statement") from None
        if not only_imports(statement) or len(statement.body) != 1:
            raise ExportError(f"{where}: not one Python import statement")
        rewritten = _rewrite_imports(cst.Module(body=[statement]).code, tree.carried, None, where)
        statements.append(cst.parse_statement(rewritten))
    return statements


def apply_fix(fix: Fix, tree: Tree, carry_new_files: bool = True) -> list[str]:
    """Write `fix` into `tree`; returns the repository paths it changed."""
    pristine = tree.python_dir
    touched = _carry_new_files(fix, tree, pristine) if carry_new_files else []
    written = _written_functions(fix, tree)
    modules = list(dict.fromkeys([w.module for w in written] + list(fix.imports)))
    for module in modules:
        path = tree.module_file(module)
        if path is None:
            raise ExportError(
                f"fix {fix.id}: module {module} is not in the upstream tree {pristine}"
            )
        before = tree.text(path)
        parsed = cst.parse_module(before)
        statements = list(parsed.body)
        if module in fix.imports:
            statements = _insert_imports(statements, _import_statements(fix, module, tree))
            for name, value in declared_bindings(fix, module, tree).items():
                tree.bindings[(module, name)] = value
        future = has_future_annotations(parsed)
        ours = [w for w in written if w.module == module]
        for w in ours:
            if w.in_class:
                _check_class_safe(w)
            statements = _in_class(
                statements, w.class_path, _writer(w, path, future), w.label, path
            )
            if not w.replaces and not w.in_class:
                tree.bindings[(module, w.name)] = w.registered
        text = parsed.with_changes(body=statements).code
        text = format_written(before, text, [(w.class_path, w.name) for w in ours], pristine)
        if module in fix.imports and sort_imports(before, pristine) == before:
            text = sort_imports(text, pristine)
        patched = ast.parse(text)
        for w in ours:
            check_names(w, patched, future, tree)
        if text != before:
            tree.texts[path] = text
            touched.append(path)
    return touched


def _writer(w: Written, path: str, future: bool) -> Callable[[list], list]:
    """The edit of a statement list (module or class body) that writes `w` into it."""

    def edit(body: list) -> list:
        index = _def_index(body, (cst.FunctionDef, cst.ClassDef), w.name, w.label, path)
        if w.replaces:
            if index is None or not isinstance(body[index], cst.FunctionDef):
                raise ExportError(f"{w.label}: not found in {path}")
            body[index] = _replacement(w, body[index], path)
            return body
        if index is not None:
            raise ExportError(f"{w.label}: {path} already defines {w.name}; is the fix upstream?")
        if w.in_class:
            return body + [w.node.with_changes(leading_lines=[_blank()])]
        if w.takes_routes:
            return _take_routes(body, w, path)
        at_def, at_call = used_globals(w.source, w.func.__name__, future)
        return _insert_module_level(body, w, at_def | at_call)

    return edit


def _take_routes(body: list, w: Written, path: str) -> list:
    """Move the endpoint's route decorators onto `w`, written right after it (fix.Routes)."""
    endpoint = w.takes_routes.endpoint
    index = _def_index(body, (cst.FunctionDef,), endpoint, w.label, path)
    if index is None:
        raise ExportError(f"{w.label}: the endpoint {endpoint} is not in {path}")
    original = body[index]
    if not original.decorators:
        raise ExportError(f"{w.label}: {endpoint} in {path} has no route decorators to take")
    body[index] = original.with_changes(decorators=[])
    taken = w.node.with_changes(
        decorators=list(original.decorators), leading_lines=[_blank(), _blank()]
    )
    return body[: index + 1] + [taken] + body[index + 1 :]


def commit_message(fix: Fix) -> str:
    """Subject `<area>: <title>`, Why / How, then DEP-3 fields."""

    def wrap(name: str, value: str, indent: str) -> str:
        return textwrap.fill(
            f"{name}: {value}", 72, subsequent_indent=indent, break_on_hyphens=False
        )

    upstream = fix.upstream.strip()
    forwarded = (
        upstream.removeprefix("forwarded:").strip() if upstream.startswith("forwarded:") else "no"
    )
    applied = "no" if upstream == "not upstream" or upstream.startswith("forwarded:") else upstream
    fields = [
        wrap("Origin", f"vendor, {AUTHOR_NAME}, fix {fix.id}", " "),
        wrap("Forwarded", forwarded, " "),
        wrap("Applied-Upstream", applied, " "),
        wrap("Remove-When", fix.remove_when, " "),
        wrap("Last-Update", LAST_UPDATE, " "),
    ]
    parts = [f"{fix.area}: {fix.title}", wrap("Why", fix.why, ""), wrap("How", fix.how, "")]
    return "\n\n".join(parts + ["\n".join(fields)]) + "\n"


def new_files_message(fix: Fix) -> str:
    """The message of the patch that carries a fix's new files (its kernels) on their own."""
    lines = [f"{fix.area}: kernels for {fix.title} (new files)"]
    for module, source in fix.new_files.items():
        doc = (importlib.import_module(source).__doc__ or "").strip().split("\n\n")[0]
        lines.append(textwrap.fill(f"{module}: {' '.join(doc.split())}", 72, subsequent_indent=" "))
    lines.append(
        textwrap.fill(
            f"Standalone: nothing imports these modules until the next patch ({fix.title}).",
            72,
        )
    )
    return "\n\n".join(lines) + "\n\n" + commit_message(fix).split("\n\n")[-1]


def _summary(fix: Fix) -> str:
    parts = [
        f"{len(fix.replaces)} replaced" if fix.replaces else "",
        f"{len(fix.adds)} added" if fix.adds else "",
        f"{sum(map(len, fix.imports.values()))} import(s)" if fix.imports else "",
        f"{len(fix.new_files)} new file(s)" if fix.new_files else "",
    ]
    return ", ".join(p for p in parts if p)


def export_series(fixes: Sequence[Fix], python_dir: Path, out: Path) -> list[Outcome]:
    """Write one patch per carried change of `fixes` (register order) and `series` into `out`."""
    tree = Tree(python_dir)
    outcomes, snapshots = [], []
    for fix in fixes:
        if fix.upstream.strip().startswith("upstream since"):
            outcomes.append(Outcome(fix, note=f"{fix.upstream}: already upstream, no patch"))
        elif not fix.implemented:
            outcomes.append(Outcome(fix, note="declared, not implemented: no patch"))
        else:
            outcome = Outcome(fix, note=_summary(fix))
            if fix.new_files:
                _carry_new_files(fix, tree, tree.python_dir)
                snapshots.append((new_files_message(fix), outcome, dict(tree.texts)))
            if apply_fix(fix, tree, carry_new_files=False):
                snapshots.append((commit_message(fix), outcome, dict(tree.texts)))
            elif not fix.new_files:
                outcome.note = "its functions equal upstream's at the pin: no patch"
            outcomes.append(outcome)
    with tempfile.TemporaryDirectory(prefix="sglang-dsv4-export-") as tmp:
        repo = Path(tmp) / "upstream"
        repo.mkdir()
        for path in tree.texts:
            source = python_dir / path.removeprefix("python/")
            if source.is_file():
                (repo / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, repo / path)
        init_repo(repo)
        for text_of_message, _, texts in snapshots:
            for path, text in texts.items():
                (repo / path).parent.mkdir(parents=True, exist_ok=True)
                (repo / path).write_text(text)
            message = Path(tmp) / "message"
            message.write_text(text_of_message)
            git(["add", "--all"], repo)
            git(["commit", "--quiet", "--cleanup=whitespace", f"--file={message}"], repo)
        patches = Path(tmp) / "patches"
        names: list[str] = []
        if snapshots:
            git(
                [
                    "format-patch",
                    "--quiet",
                    "--zero-commit",
                    "--no-signature",
                    "--full-index",
                    "--numbered",
                    "--no-renames",
                    f"--output-directory={patches}",
                    f"HEAD~{len(snapshots)}",
                ],
                repo,
            )
            names = sorted(p.name for p in patches.glob("*.patch"))
        if len(names) != len(snapshots):
            raise ExportError(
                f"git format-patch wrote {len(names)} patches for {len(snapshots)} changes"
            )
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("[0-9][0-9][0-9][0-9]-*.patch"), out / "series"]:
            stale.unlink(missing_ok=True)
        for name, (_, outcome, _) in zip(names, snapshots, strict=True):
            shutil.copyfile(patches / name, out / name)
            outcome.patches.append(name)
        (out / "series").write_text("".join(f"{name}\n" for name in names))
    return outcomes


def require_fresh(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(
            f"{dest} is not an empty directory; the pristine tree goes into a fresh one"
        )


def apply_series(out: Path, python_dir: Path, dest: Path) -> list[str]:
    """Lay the pristine upstream tree out in `dest` as a git repository and `git am` the series."""
    require_fresh(dest)
    names = (out / "series").read_text().split()
    shutil.copytree(
        python_dir / "sglang",
        dest / "python" / "sglang",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    init_repo(dest)
    if names:
        git(["am", "--quiet", *[str((out / name).resolve()) for name in names]], dest)
    return names


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for the patches and series"
    )
    parser.add_argument(
        "--upstream-src",
        type=Path,
        help=f"upstream sglang {UPSTREAM_PIN} source (repository root or its python/); "
        "default: the pinned wheel, downloaded once into the cache",
    )
    parser.add_argument(
        "--apply-to",
        type=Path,
        metavar="DIR",
        help="also lay the pristine upstream tree out in DIR (a git repository, python/sglang/...) "
        "and apply the series there with git am",
    )


def run(args) -> int:
    try:
        if args.apply_to:
            require_fresh(args.apply_to)
        python_dir = upstream_python_dir(args.upstream_src)
        from sglang_dsv4.fixes import FIXES  # imports upstream: after the cheap checks

        outcomes = export_series(FIXES, python_dir, args.out)
        width = max(len(o.fix.id) for o in outcomes) if outcomes else 0
        for o in outcomes:
            names = ", ".join(o.patches)
            print(f"{o.fix.id:<{width}}  {names + ' (' + o.note + ')' if names else o.note}")
        count = sum(len(o.patches) for o in outcomes)
        print(
            f"wrote {count} patch(es) and series to {args.out} (upstream sglang {UPSTREAM_PIN}, {python_dir})"
        )
        if args.apply_to:
            names = apply_series(args.out, python_dir, args.apply_to)
            print(
                f"applied {len(names)} patch(es) with git am to the pristine tree in {args.apply_to}"
            )
    except ExportError as exc:
        print(f"sglang-dsv4 export-patches: error: {exc}", file=sys.stderr)
        return 1
    return 0
