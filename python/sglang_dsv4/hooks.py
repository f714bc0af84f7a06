"""The layer under every hook the distribution puts into upstream's code.

Resolve a dotted target; check it against what a change was written for (a structured `Reason`,
never a sentence to match); install through upstream's HookRegistry (or as an added attribute);
verify that what runs is what was installed; point a FastAPI application's routes at an added
endpoint. The plugin installs the fixes with it, the sanitizer its diagnostic hooks, and
rebase-check prechecks every fix on another upstream tree with it.

It imports only `sglang_dsv4.fix` (the entry types); upstream's HookRegistry is imported by the
functions that install, so checking imports nothing but the targets' owners.
"""

from __future__ import annotations

import enum
import inspect
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sglang_dsv4.fix import Add, Replace, parameters_of


class Refusal(SystemExit):
    """The distribution cannot run as configured; the message is the one line an operator reads.

    A `SystemExit`, so upstream's plugin loader (which logs and swallows every `Exception`) does
    not serve unpatched: the process stops.
    """

    def __init__(self, message: str):
        super().__init__(f"sglang-dsv4: refusing to run: {message}")


class Problem(enum.Enum):
    """What is wrong with a target, as decisions read it (the text is for people)."""

    NO_OWNER = "its owner does not import"
    NOT_FOUND = "not found upstream"
    SIGNATURE = "signature changed"
    UPSTREAM_DEFINES = "upstream now defines what the fix adds"
    NOT_AN_APP = "not a FastAPI application"
    NO_ROUTE = "no route serves the endpoint"
    ALREADY_PATCHED = "already patched by another hook"
    NOT_INSTALLED = "what runs is not what was installed"
    FIX_DOES_NOT_IMPORT = "the fix module does not import"
    NOT_IN_REGISTER_MODULES = "a target in none of the register entry's modules"


@dataclass(frozen=True)
class Reason:
    """Why a change cannot be (or is not) in force: the kind, for code; the line, for people."""

    problem: Problem
    text: str

    def __str__(self) -> str:
        return self.text

    @property
    def upstream_has_it(self) -> bool:
        """The tree already defines what the change adds: a sign the fix went upstream."""
        return self.problem is Problem.UPSTREAM_DEFINES

    def as_json(self) -> dict:
        return {"problem": self.problem.name, "text": self.text}

    @classmethod
    def from_json(cls, data: dict | None) -> Reason | None:
        return None if data is None else cls(Problem[data["problem"]], data["text"])


def _at(target: str, problem: Problem, detail: str) -> Reason:
    return Reason(problem, f"target {target}: {detail}")


def resolve(target: str):
    """(owner, attribute name, raw attribute or None) for a dotted path; descriptors unwrapped."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return owner, name, raw


def _resolved(target: str):
    """(raw attribute or None, None) or (None, the Reason its owner cannot be imported)."""
    try:
        return resolve(target)[2], None
    except (ImportError, AttributeError, ValueError) as exc:
        return None, _at(target, Problem.NO_OWNER, f"cannot import its owner ({exc})")


def installs(current, func) -> bool:
    """True when `current` is `func` or a hook wrapper (chain) that calls it."""
    seen = 0
    while current is not None and seen < 16:
        if current is func:
            return True
        cells = getattr(current, "__closure__", None) or ()
        if any(_cell(c) is func for c in cells):
            return True
        current = getattr(current, "__wrapped__", None)
        seen += 1
    return False


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


# --- checks: is the target what the change was written for? ------------------------------------


def moved(target: str, original, signature: str) -> Reason | None:
    """Why upstream's `original` (None: absent) is not what a change written for `signature`
    needs, or None."""
    if original is None:
        return _at(target, Problem.NOT_FOUND, "not found upstream")
    found = parameters_of(original)
    if found != signature:
        return _at(
            target,
            Problem.SIGNATURE,
            f"signature is {found}, the fix was written for {signature}",
        )
    return None


def check_replace(rep: Replace) -> Reason | None:
    """Why the replacement cannot be installed on this upstream tree, or None."""
    original, reason = _resolved(rep.target)
    return reason or moved(rep.target, original, rep.signature)


def check_add(add: Add) -> Reason | None:
    existing, reason = _resolved(add.target)
    if reason:
        return reason
    if existing is not None and existing is not add.func:
        return _at(
            add.target, Problem.UPSTREAM_DEFINES, "upstream now defines it; is the fix upstream?"
        )
    return _check_routes(add) if add.takes_routes else None


def precheck(fix) -> Reason | None:
    """Why `fix` cannot be installed on the upstream tree this process imports, or None."""
    for reason in (*map(check_replace, fix.replaces), *map(check_add, fix.adds)):
        if reason:
            return reason
    return None


# --- HTTP routes an added function takes over (fix.Routes) -------------------------------------


def _endpoint_and_routes(add: Add):
    """(the upstream endpoint, its application's route list); None for what is not there."""
    owner = pkgutil.resolve_name(add.owner)
    app = getattr(owner, add.takes_routes.app, None)
    routes = getattr(getattr(app, "router", None), "routes", None)
    return getattr(owner, add.takes_routes.endpoint, None), routes


def _serving(routes, func) -> list[str]:
    return [route.path for route in routes if getattr(route, "endpoint", None) is func]


def _check_routes(add: Add) -> Reason | None:
    taken = add.takes_routes
    target = f"{add.owner}.{taken.endpoint}"
    endpoint, routes = _endpoint_and_routes(add)
    if reason := moved(target, endpoint, taken.signature):
        return reason
    if routes is None:
        return _at(
            target, Problem.NOT_AN_APP, f"{add.owner}.{taken.app} is not a FastAPI application"
        )
    if not (_serving(routes, endpoint) or _serving(routes, add.func)):
        return _at(target, Problem.NO_ROUTE, f"no route of {taken.app} serves it")
    return None


def _route_to(route, func):
    """The same route (class, path and every constructor argument it keeps) served by `func`."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    kept = {
        name: getattr(route, name)
        for name, param in inspect.signature(type(route).__init__).parameters.items()
        if param.kind in named and name not in ("self", "path", "endpoint") and hasattr(route, name)
    }
    return type(route)(route.path, func, **kept)


def take_routes(add: Add) -> None:
    """Point every route serving the upstream endpoint at the added function, in its place."""
    endpoint, routes = _endpoint_and_routes(add)
    for index, route in enumerate(routes):
        if getattr(route, "endpoint", None) is endpoint:
            routes[index] = _route_to(route, add.func)


def _verify_routes(add: Add) -> Reason | None:
    endpoint, routes = _endpoint_and_routes(add)
    target = f"{add.owner}.{add.takes_routes.endpoint}"
    if left := _serving(routes, endpoint):
        return _at(target, Problem.NOT_INSTALLED, f"routes {', '.join(left)} still serve it")
    if not _serving(routes, add.func):
        return _at(target, Problem.NOT_INSTALLED, f"no route serves {add.func.__name__}")
    return None


# --- verify: is what runs what was installed? --------------------------------------------------


def _verify_replace(rep: Replace) -> Reason | None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    try:
        _, _, current = resolve(rep.target)
    except (ImportError, AttributeError, ValueError) as exc:
        return _at(rep.target, Problem.NO_OWNER, str(exc))
    if rep.target not in HookRegistry._patched or not installs(current, rep.func):
        return _at(
            rep.target, Problem.NOT_INSTALLED, "not patched (upstream's HookRegistry logged why)"
        )
    return None


def _verify_add(add: Add) -> Reason | None:
    try:
        _, _, current = resolve(add.target)
    except (ImportError, AttributeError, ValueError) as exc:
        return _at(add.target, Problem.NO_OWNER, str(exc))
    if current is not add.func:
        return _at(add.target, Problem.NOT_INSTALLED, "not added")
    return _verify_routes(add) if add.takes_routes else None


def verify(fix) -> Reason | None:
    """Why the fix is not in force in this process, or None (imports every target's owner)."""
    for reason in (*map(_verify_replace, fix.replaces), *map(_verify_add, fix.adds)):
        if reason:
            return reason
    return None


# --- install ------------------------------------------------------------------------------------


def install(replaces: Sequence[Replace], adds: Sequence[Add]) -> Reason | None:
    """Check, install and verify a change's targets (their modules are imported); why not, or
    None. Replacements go through upstream's HookRegistry; additions are set on their owner."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for reason in (*map(check_replace, replaces), *map(check_add, adds)):
        if reason:
            return reason
    for rep in replaces:
        HookRegistry.register(rep.target, rep.func, HookType.REPLACE)
    for add in adds:
        owner, name, _ = resolve(add.target)
        setattr(owner, name, add.func)
        if add.takes_routes:
            take_routes(add)
    if replaces:
        HookRegistry.apply_hooks()
    for reason in (*map(_verify_replace, replaces), *map(_verify_add, adds)):
        if reason:
            return reason
    return None


@dataclass(frozen=True)
class Hook:
    """A hook of another kind than a fix's replacement (BEFORE, AFTER, AROUND: upstream's
    HookType names) on an upstream function that must exist and be unpatched."""

    target: str
    func: Callable
    kind: str


def install_hooks(hooks: Sequence[Hook], what: str = "hook") -> Reason | None:
    """Register and apply `hooks` with upstream's HookRegistry and verify each took; why the
    first did not, or None. Nothing is registered unless every target checks out."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    before = {}
    for hook in hooks:
        try:
            before[hook.target] = resolve(hook.target)[2]
        except (ImportError, AttributeError, ValueError) as exc:
            return Reason(Problem.NO_OWNER, f"{what} {hook.target}: cannot import its owner ({exc})")
        if before[hook.target] is None:
            return Reason(Problem.NOT_FOUND, f"{what} {hook.target}: not found upstream")
        if hook.target in HookRegistry._patched:
            return Reason(
                Problem.ALREADY_PATCHED, f"{what} {hook.target}: already patched by another hook"
            )
    for hook in hooks:
        HookRegistry.register(hook.target, hook.func, HookType[hook.kind])
    HookRegistry.apply_hooks()
    for hook in hooks:
        if hook.target not in HookRegistry._patched or resolve(hook.target)[2] is before[hook.target]:
            return Reason(
                Problem.NOT_INSTALLED, f"{what} {hook.target}: did not take (see upstream's log)"
            )
    return None
