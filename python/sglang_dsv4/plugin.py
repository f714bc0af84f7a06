"""The general plugin upstream's `load_plugins()` runs in every SGLang process.

Upstream catches and logs every `Exception` a plugin or a hook raises, then serves unpatched.
`SystemExit` is not an `Exception`, so raising `Refusal` (a `SystemExit`) stops the process:
`python -m sglang.launch_server` calls `load_plugins()` before parsing its arguments, and every
scheduler / detokenizer process calls it first thing.

Start-up cost: `load()` checks the pin and the settings and imports no fix and no upstream module
a fix hooks (those take seconds and hundreds of MB, and `launch_server --help` or a router needs
none of them). It reads the register's names (`sglang_dsv4.fixes.REGISTER`) and watches the
import of each upstream module holding a target. Once upstream imports such a module (and the
import that pulled it in has finished, so no upstream module is half-initialised), the fix module
is imported and the targets in that module are prechecked, registered with upstream's
HookRegistry, applied and verified (`sglang_dsv4.hooks`). A failure there refuses as at start-up, at the latest when
the target's module is first imported: in a scheduler that is the refusal line on its stderr and
upstream's launcher reporting the dead scheduler. Targets whose module is already imported when
the plugin loads are handled inside `load()`. `settle()` imports everything and applies every fix
at once (`sglang-dsv4 status`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from sglang_dsv4 import UPSTREAM_PIN, hooks, settings
from sglang_dsv4.hooks import Refusal

logger = logging.getLogger("sglang_dsv4")

APPLIED = "applied"
PENDING = "pending"
DECLARED = "declared, not implemented"
FAILED = "failed"
SKIPPED = "skipped"


@dataclass
class FixState:
    status: str
    reason: str = ""

    @property
    def applied(self) -> bool:
        return self.status == APPLIED


# fix id -> state, filled by `load()`; empty until the plugin ran in this process.
STATE: dict[str, FixState] = {}
_loaded = False


def upstream_version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def check_upstream_version(allow_unpinned: bool) -> None:
    found = upstream_version()
    if found == UPSTREAM_PIN:
        return
    line = f"upstream sglang is {found}, the distribution is pinned to {UPSTREAM_PIN}"
    if not allow_unpinned:
        raise Refusal(f"{line} (set {settings.ALLOW_UNPINNED_ENV}=1 to run anyway)")
    logger.warning("sglang-dsv4: %s; running anyway (%s=1)", line, settings.ALLOW_UNPINNED_ENV)


# --- one fix: its targets by upstream module ---------------------------------------------------


@dataclass
class _Watched:
    """A fix being applied module by module as upstream imports them."""

    entry: object  # sglang_dsv4.fixes.Entry
    fix: object = None  # its Fix, once the fix module is imported
    done: set[str] = field(default_factory=set)  # upstream modules whose targets are in force

    def waiting_for(self) -> list[str]:
        return [m for m in self.entry.upstream_modules if m not in self.done]


_watched: dict[str, _Watched] = {}  # fix id -> progress, for fixes not yet applied in full
_lock = threading.RLock()
_local = threading.local()  # per thread: depth of upstream imports, and whether applying


def _imported(module: str) -> bool:
    """Whether `module` is imported and has finished executing."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    # importlib clears `_initializing` only after the loader returns: the module whose
    # exec_module just returned (see `_counting`) is complete although still marked.
    return module == getattr(_local, "executed", None) or not getattr(
        getattr(mod, "__spec__", None), "_initializing", False
    )


def _module_of(target: str, modules) -> str | None:
    """The register module that holds `target` (the longest that is a prefix of it)."""
    owners = [m for m in modules if target.startswith(m + ".")]
    return max(owners, key=len) if owners else None


def _advance(watched: _Watched) -> str | None:
    """Apply the targets of one fix whose modules are imported now; why it failed, or None."""
    entry = watched.entry
    if watched.fix is None:
        try:
            watched.fix = entry.load()
        except Exception as exc:  # a fix module that does not import is a fix that did not apply
            return f"cannot import {entry.module} ({type(exc).__name__}: {exc})"
        for target in watched.fix.hooked_targets:
            if _module_of(target, entry.upstream_modules) is None:
                return (
                    f"target {target} is in none of the modules its register entry lists "
                    f"({', '.join(entry.upstream_modules)}; sglang_dsv4/fixes/__init__.py)"
                )
    for module in watched.waiting_for():
        if not _imported(module):
            continue
        mods = entry.upstream_modules
        replaces = [r for r in watched.fix.replaces if _module_of(r.target, mods) == module]
        adds = [a for a in watched.fix.adds if _module_of(a.target, mods) == module]
        if reason := hooks.install(replaces, adds):
            return str(reason)
        watched.done.add(module)
    return None


def _pending_state(watched: _Watched) -> FixState:
    waiting = watched.waiting_for()
    if not waiting:
        return FixState(APPLIED)
    return FixState(PENDING, f"applies when upstream imports {', '.join(waiting)}")


def _apply_ready() -> None:
    """Apply every watched target whose module is imported; refuse on the first failure."""
    if getattr(_local, "applying", False):
        return  # importing a fix module imported upstream modules: the loop below sees them
    with _lock:
        _local.applying = True
        try:
            progress = True
            while progress and _watched:
                progress = False
                for fix_id, watched in list(_watched.items()):
                    if not any(map(_imported, watched.waiting_for())):
                        continue
                    before = len(watched.done)
                    if reason := _advance(watched):
                        _fail(fix_id, reason)
                        continue
                    STATE[fix_id] = _pending_state(watched)
                    if STATE[fix_id].applied:
                        del _watched[fix_id]
                        logger.info("sglang-dsv4: fix %s applied", fix_id)
                    progress |= len(watched.done) > before
        finally:
            _local.applying = False


def _fail(fix_id: str, reason: str) -> None:
    STATE[fix_id] = FixState(FAILED, reason)
    _watched.pop(fix_id, None)
    failures = getattr(_local, "failures", None)
    if failures is not None:  # settle(refuse=False): record, keep checking the others
        failures.append(str(Refusal(f"fix {fix_id}: {reason}").code))
        return
    _refuse(f"fix {fix_id}: {reason}")


def _refuse(message: str) -> None:
    if threading.current_thread() is threading.main_thread():
        raise Refusal(message)
    # SystemExit in another thread ends only that thread, silently: stop the process instead.
    sys.stderr.write(f"{Refusal(message).code}\n")
    sys.stderr.flush()
    os._exit(1)


# --- the import watch ---------------------------------------------------------------------------


class _UpstreamImportWatch:
    """A meta-path finder for `sglang` modules (and fix modules): when the outermost of them
    being imported in a thread has finished, it applies what became ready, so no upstream module
    is half-initialised then. It finds nothing itself: it asks the finders after it and wraps the
    found loader's `exec_module` (on that loader instance only, so the loader keeps its class)."""

    def __init__(self):
        # Fix modules count as well: one imported by other code (export, tests) imports upstream
        # modules, and must finish before it can be applied.
        self.fix_modules: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if not (name == "sglang" or name.startswith("sglang.") or name in self.fix_modules):
            return None
        finders = sys.meta_path
        for finder in finders[finders.index(self) + 1 :] if self in finders else ():
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                loader = spec.loader
                exec_module = getattr(loader, "exec_module", None)
                if exec_module is not None and not hasattr(exec_module, "_sglang_dsv4"):
                    try:
                        loader.exec_module = _counting(exec_module)
                    except (AttributeError, TypeError):  # a loader that takes no attributes
                        pass
                return spec
        return None

    def invalidate_caches(self):
        pass


def _counting(exec_module):
    def exec_and_apply(module):
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            exec_module(module)
        finally:
            _local.depth -= 1
        if _local.depth == 0 and _watched and not getattr(_local, "applying", False):
            _local.executed = module.__name__
            try:
                _apply_ready()
            finally:
                _local.executed = None

    exec_and_apply._sglang_dsv4 = True
    return exec_and_apply


_WATCH = _UpstreamImportWatch()


def _watch_imports() -> None:
    if _WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _WATCH)


def settle(refuse: bool = True) -> list[str]:
    """Import every module the pending fixes hook and apply them now.

    A failure refuses (the process stops), or with `refuse=False` is only recorded in STATE so
    that every other fix is still checked; returns the refusal lines.
    """
    _local.failures = None if refuse else []
    try:
        for watched in list(_watched.values()):
            for module in watched.waiting_for():
                if watched.entry.id not in _watched:
                    break  # failed while an earlier module was imported
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    _fail(watched.entry.id, f"cannot import {module} ({exc})")
                    break
        _apply_ready()
        return list(_local.failures or ())
    finally:
        _local.failures = None


def load() -> None:
    """Entry point `dsv4_sm120` of the group `sglang.srt.plugins`."""
    global _loaded
    if _loaded:
        return
    try:
        conf = settings.current()
    except settings.SettingsError as exc:
        raise Refusal(str(exc)) from None
    check_upstream_version(conf.allow_unpinned)

    from sglang_dsv4 import cpu_backend
    from sglang_dsv4.fixes import REGISTER

    try:  # --device cpu on DeepSeek-V4 only; elsewhere no entry, nothing hooked
        dev_entries = cpu_backend.entries()
    except ValueError as exc:
        raise Refusal(str(exc)) from None
    for entry in (*REGISTER, *dev_entries):
        if entry.id in conf.skip_fixes:
            STATE[entry.id] = FixState(SKIPPED, f"{settings.SKIP_FIXES_ENV} names it")
        elif not entry.implemented:
            STATE[entry.id] = FixState(DECLARED)
        else:
            _watched[entry.id] = watched = _Watched(entry)
            _WATCH.fix_modules.add(entry.module)
            STATE[entry.id] = _pending_state(watched)
    _loaded = True
    _watch_imports()
    _apply_ready()  # modules this process imported before loading plugins
    from sglang_dsv4 import sanitizer  # SGLANG_DSV4_SANITIZE=1 only; off installs nothing

    sanitizer.install_from_settings(conf)
    logger.info(
        "sglang-dsv4: %d fix(es) applied, %d pending until upstream imports their modules, "
        "index-K dtype %s",
        sum(st.status == APPLIED for st in STATE.values()),
        sum(st.status == PENDING for st in STATE.values()),
        conf.index_k_dtype,
    )
