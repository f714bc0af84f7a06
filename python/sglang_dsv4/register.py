"""The shape of a carried change: what it replaces or adds upstream, and why.

A fix is written as whole functions or methods (replacements of upstream ones, or additions), so
the same objects serve both deliveries: the runtime hooks (`sglang_dsv4.plugin`) and the patch
series upstream can apply (`sglang-dsv4 export-patches`). A replacement is written as it would
stand in the upstream file: it may only use names that file defines or imports, names the fix
adds to it, and the imports the fix declares for it.

Code of the distribution's own packages (the kernels in `sgl_kernel_dsv4`) reaches upstream's tree
through `Fix.new_files`: each listed module is copied into the patch as a new upstream module, and
imports of it (in `Fix.imports` and in other carried files) are rewritten to that upstream name.
The fix module imports the kernel from `sgl_kernel_dsv4` as usual; the runtime hook runs that.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Replace:
    """Replace the upstream function or method at `target` with `func`."""

    target: str  # dotted path, e.g. "sglang.srt.x.Class.method"
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
    # {"sglang.srt.layers.attention.dsv4.bf16_index_logits": "sgl_kernel_dsv4.logits"}.
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
