"""The entry types of the fix register: what a carried change replaces or adds upstream, and why.

A fix is written as whole functions or methods (replacements of upstream ones, or additions), so
the same objects serve both deliveries: the runtime hooks (`sglang_dsv4.plugin`, through
`sglang_dsv4.hooks`) and the patch series upstream can apply (`sglang-dsv4 export-patches`). A
replacement is written as it would stand in the upstream file: it may only use names that file
defines or imports, names the fix adds to it, and the imports the fix declares for it.

Code of the distribution's own packages (the kernels in `sgl_kernel_dsv4`, the index-K dtype rule
in `sglang_dsv4.index_k_dtype`) reaches upstream's tree either as functions the fix adds to an
upstream module (`Add`), or through `Fix.new_files`: each listed module is copied into the patch
as a new upstream module, and imports of it (in `Fix.imports` and in other carried files) are
rewritten to that upstream name. The fix module imports the kernel from `sgl_kernel_dsv4` as
usual; the runtime hook runs that.

Each fix's register text (Target / Why / How / Upstream / Remove when) has one source, its `Fix`:
`register_text(fix)` renders it, and the fix module's docstring opens with exactly that text
(test/test_plugin.py checks it; `python -m sglang_dsv4.fix` rewrites the docstrings from the
register after an edit).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Replace:
    """Replace the upstream function or method at `target` with `func`."""

    target: str  # dotted path, e.g. "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc"
    func: Callable
    # The parameters of the upstream original the fix was written against (see `parameters_of`).
    # A different signature at apply time means upstream moved: the fix refuses to apply.
    signature: str


@dataclass(frozen=True)
class Routes:
    """The HTTP routes an added function takes over from an upstream endpoint.

    FastAPI keeps the function a route was declared with, so replacing an endpoint in its module
    changes nothing that is served. The added function serves the endpoint's routes instead and
    calls the endpoint itself, so upstream's handler stays upstream's: the hook points the
    application's routes at the added function, the patch moves the endpoint's route decorators
    onto it.
    """

    endpoint: str  # the endpoint function's name in the Add's owner module
    # Its parameters, as for Replace: the added function calls it with them.
    signature: str
    app: str = "app"  # the FastAPI application's name in that module


@dataclass(frozen=True)
class Add:
    """Add `func` (under its own name) to the upstream module or class `owner`."""

    owner: str  # dotted path of a module or a class
    func: Callable
    # Set when `func` serves the routes of an upstream endpoint in `owner` (a module).
    takes_routes: Routes | None = None

    @property
    def name(self) -> str:
        return self.func.__name__

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.name}"


@dataclass(frozen=True)
class Fix:
    """One register entry (in the spirit of DEP-3 headers and vllm-ascend's patch register)."""

    id: str
    title: str
    area: str  # subject prefix of the exported patch, e.g. "mem_cache"
    why: str
    how: str
    upstream: str  # "not upstream", "forwarded: URL" or "upstream since X.Y.Z"
    remove_when: str
    # Dotted upstream paths the change concerns (also those it does not touch yet).
    targets: tuple[str, ...]
    # The fix's behaviour tests (repository paths under test/behaviour/): they fail on upstream
    # without the fix and pass with either delivery; `sglang-dsv4 rebase-check` runs them on
    # another upstream tree to tell whether the fix is still needed.
    tests: tuple[str, ...] = ()
    replaces: tuple[Replace, ...] = ()
    adds: tuple[Add, ...] = ()
    # Import lines the exported patch adds to an upstream module, keyed by module.
    imports: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Modules of the distribution the patch carries into upstream's tree as new files:
    # upstream module name -> distribution module, e.g.
    # {"sglang.kernels.ops.attention.dsv4.bf16_index_logits": "sgl_kernel_dsv4.index_logits"}.
    new_files: Mapping[str, str] = field(default_factory=dict)

    @property
    def implemented(self) -> bool:
        return bool(self.replaces or self.adds)

    @property
    def hooked_targets(self) -> tuple[str, ...]:
        return tuple(r.target for r in self.replaces) + tuple(a.target for a in self.adds)


def parameters_of(func: Callable) -> str:
    """A function's parameters as "(a, b=1, *, c)": names, kinds and defaults, no annotations.

    Annotations are left out because they are strings or objects depending on the module's
    `from __future__ import annotations`; what breaks a replacement is a changed parameter list.
    """
    sig = inspect.signature(func, follow_wrapped=False)
    bare = sig.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return str(bare)


# --- the register text: rendered from a Fix, the opening of its module's docstring ---------------

_FIELD_WIDTH = 15  # "  Remove when: "
_LINE_LENGTH = 100


def _field(name: str, value: str) -> str:
    return textwrap.fill(
        " ".join(value.split()),
        _LINE_LENGTH,
        initial_indent=f"  {name + ':':<{_FIELD_WIDTH - 2}}",
        subsequent_indent=" " * _FIELD_WIDTH,
        break_long_words=False,
        break_on_hyphens=False,
    )


def register_text(fix: Fix) -> str:
    """The opening of the fix module's docstring: its title line and its register entry."""
    targets = "\n".join(
        f"  {'Target:' if i == 0 else '':<{_FIELD_WIDTH - 2}}{t}" for i, t in enumerate(fix.targets)
    )
    lines = [
        f"{fix.id}: {fix.title}.",
        "",
        "Register entry",
        targets,
        _field("Why", fix.why),
        _field("How", fix.how),
        _field("Upstream", fix.upstream),
        _field("Remove when", fix.remove_when),
    ]
    return "\n".join(lines) + "\n"


def docstring_problem(fix: Fix, doc: str | None) -> str | None:
    """Why a fix module's docstring does not open with its register text, or None."""
    if (doc or "").startswith(register_text(fix)):
        return None
    return (
        f"the docstring of fix {fix.id} does not open with its register text "
        "(run `python -m sglang_dsv4.fix` to write it from the Fix)"
    )


def write_docstrings() -> list[str]:
    """Rewrite each fix module's register text from its Fix; the paths changed."""
    import ast
    import importlib
    from pathlib import Path

    from sglang_dsv4.fixes import REGISTER

    changed = []
    for entry in REGISTER:
        module = importlib.import_module(entry.module)
        path = Path(module.__file__)
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source), clean=False) or ""
        if docstring_problem(module.FIX, doc) is None:
            continue
        # The old register text runs from the top to the first blank line after "Remove when:".
        head, sep, rest = doc.partition("  Remove when:")
        rest = rest.split("\n\n", 1)[1] if "\n\n" in rest else ""
        new_doc = register_text(module.FIX) + ("\n" + rest if rest else "")
        start = source.index('"""') + 3
        end = source.index('"""', start)
        path.write_text(source[:start] + new_doc + source[end:])
        changed.append(str(path))
    return changed


if __name__ == "__main__":
    for changed_path in write_docstrings():
        print(changed_path)
