"""The general plugin upstream's `load_plugins()` runs in every SGLang process.

Upstream catches and logs every `Exception` a plugin or a hook raises, then serves unpatched.
`SystemExit` is not an `Exception`, so raising `Refusal` (a `SystemExit`) from the plugin stops
the process: `python -m sglang.launch_server` calls `load_plugins()` before parsing its arguments,
and every scheduler / detokenizer process calls it first thing. To check the hooks inside the
plugin call, the plugin applies them itself (`HookRegistry.apply_hooks()` is idempotent), then
verifies every target of every implemented fix.
"""

from __future__ import annotations

import logging
import pkgutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from sglang_dsv4 import UPSTREAM_PIN, settings
from sglang_dsv4.register import Fix, parameters_of

logger = logging.getLogger("sglang_dsv4")

APPLIED = "applied"
DECLARED = "declared, not implemented"
FAILED = "failed"
SKIPPED = "skipped"


class Refusal(SystemExit):
    """The distribution cannot run as configured; the message is the one line an operator reads."""

    def __init__(self, message: str):
        super().__init__(f"sglang-dsv4: refusing to run: {message}")


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


def resolve(target: str):
    """(owner, attribute name, raw attribute or None) for a dotted path; descriptors unwrapped."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return owner, name, raw


def _installs(current, func) -> bool:
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


def _precheck(fix: Fix) -> str | None:
    """Why the fix cannot be registered on this upstream tree, or None."""
    for rep in fix.replaces:
        try:
            _, _, original = resolve(rep.target)
        except (ImportError, AttributeError, ValueError) as exc:
            return f"target {rep.target}: cannot import its owner ({exc})"
        if original is None:
            return f"target {rep.target}: not found upstream"
        found = parameters_of(original)
        if found != rep.signature:
            return f"target {rep.target}: signature is {found}, the fix was written for {rep.signature}"
    for add in fix.adds:
        try:
            owner, name, existing = resolve(add.target)
        except (ImportError, AttributeError, ValueError) as exc:
            return f"target {add.target}: cannot import its owner ({exc})"
        if existing is not None and existing is not add.func:
            return f"target {add.target}: upstream now defines it; is the fix upstream?"
    return None


def _register(fix: Fix) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for rep in fix.replaces:
        HookRegistry.register(rep.target, rep.func, HookType.REPLACE)
    for add in fix.adds:
        owner, name, _ = resolve(add.target)
        setattr(owner, name, add.func)


def verify(fix: Fix) -> str | None:
    """Why the fix is not in force in this process, or None."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for rep in fix.replaces:
        try:
            _, _, current = resolve(rep.target)
        except (ImportError, AttributeError, ValueError) as exc:
            return f"target {rep.target}: {exc}"
        if rep.target not in HookRegistry._patched or not _installs(current, rep.func):
            return f"target {rep.target}: not patched (upstream's HookRegistry logged why)"
    for add in fix.adds:
        _, _, current = resolve(add.target)
        if current is not add.func:
            return f"target {add.target}: not added"
    return None


def apply_fixes(fixes, conf: settings.Settings) -> dict[str, FixState]:
    """Register, apply and verify `fixes`; returns their states (does not raise)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    states: dict[str, FixState] = {}
    pending = []
    for fix in fixes:
        if fix.id in conf.skip_fixes:
            states[fix.id] = FixState(SKIPPED, f"{settings.SKIP_FIXES_ENV} names it")
        elif not fix.implemented:
            states[fix.id] = FixState(DECLARED)
        elif reason := _precheck(fix):
            states[fix.id] = FixState(FAILED, reason)
        else:
            _register(fix)
            pending.append(fix)
    HookRegistry.apply_hooks()
    for fix in pending:
        reason = verify(fix)
        states[fix.id] = FixState(FAILED, reason) if reason else FixState(APPLIED)
    return states


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

    from sglang_dsv4.fixes import FIXES

    STATE.update(apply_fixes(FIXES, conf))
    _loaded = True
    failed = [(fid, st.reason) for fid, st in STATE.items() if st.status == FAILED]
    if failed:
        fid, reason = failed[0]
        more = (
            f" (and {len(failed) - 1} more fix(es); see `sglang-dsv4 status`)"
            if len(failed) > 1
            else ""
        )
        raise Refusal(f"fix {fid}: {reason}{more}")
    from sglang_dsv4 import sanitizer  # SGLANG_DSV4_SANITIZE=1 only; off installs nothing

    sanitizer.install_from_settings(conf)
    logger.info(
        "sglang-dsv4: %d fix(es) applied, index-K dtype %s",
        sum(st.applied for st in STATE.values()),
        conf.index_k_dtype,
    )
