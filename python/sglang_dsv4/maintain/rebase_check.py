"""`sglang-dsv4 rebase-check`: fix by fix, is each carried change still needed on an upstream tree?

The distribution is rebased onto every upstream release and each fix retires the day upstream has
it. For a given upstream tree (a released wheel, fetched and cached like the pinned one, or a
checkout laid out as upstream's repository) every fix of the register gets one verdict:

- needed: its patch applies and the tree lacks the behaviour (the fix's behaviour tests fail on
  the pristine tree, pass with the patch series applied and with the plugin);
- already upstream: its patch is already applied (reverse-applies), the tree defines what the fix
  adds, or its behaviour tests pass on the pristine tree without the plugin;
- broken: a target moved (missing, signature changed, a name the fix imports is gone), its patch
  does not apply (the hunk is named), or its tests fail with a delivery on that tree.

Nothing is installed: the series is exported against the pinned release (as `export-patches` does),
applied with `git apply` to a copy of the tree, and every check that imports upstream runs in a
child process with that tree first on `sys.path` (`SGLANG_PLUGINS` excludes the plugin, except in
the plugin delivery). The fix's tests are `Fix.tests` in the register.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_dsv4 import UPSTREAM_PIN, warm_python
from sglang_dsv4.hooks import Problem, Reason
from sglang_dsv4.maintain import export, upstream
from sglang_dsv4.maintain.upstream import git_env

NEEDED = "needed"
ALREADY = "already upstream"
BROKEN = "broken"

REPO_ROOT = Path(__file__).resolve().parents[3]
# Upstream's loader skips every plugin when SGLANG_PLUGINS names only one that does not exist.
NO_PLUGIN = "upstream-only"


@dataclass
class Verdict:
    id: str
    verdict: str
    evidence: str
    # What a maintainer deletes when the fix is upstream (paths of the distribution).
    remove: list[str] = field(default_factory=list)


@dataclass
class FixFacts:
    """What rebase-check learns about one fix on the tree, before the verdict."""

    id: str
    module: str
    tests: tuple[str, ...]
    patches: list[str] = field(default_factory=list)
    already_applied: list[str] = field(default_factory=list)
    not_applying: list[str] = field(default_factory=list)  # "patch: hunk" lines
    precheck: Reason | None = None  # the plugin's precheck on the tree (sglang_dsv4.hooks)
    results: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # delivery -> outcome


# --- the register, without importing upstream from the tree under test --------------------------


def register() -> list[tuple[object, str]]:
    """(Fix, module name) in register order, from the installed pin."""
    from sglang_dsv4.fixes import REGISTER

    return [(entry.load(), entry.module) for entry in REGISTER]


def probe(modules: list[str]) -> dict[str, Reason | None]:
    """In the child process: each fix module imported on its own (the register's package
    imports none), so one fix that cannot import on this tree does not hide the others'
    verdicts; then its targets are checked as the plugin checks them."""
    from sglang_dsv4.hooks import precheck

    isolation = _isolation_problem()
    if isolation:
        raise RebaseCheckError(isolation)
    found: dict[str, Reason | None] = {}
    for name in modules:
        try:
            fix = importlib.import_module(name).FIX
        except Exception as exc:  # an ImportError, or upstream code failing as it imports
            text = f"fix module {name} does not import: {_one_line(exc)}"
            found[name] = Reason(Problem.FIX_DOES_NOT_IMPORT, text)
            continue
        found[name] = precheck(fix)
    return found


def _isolation_problem() -> str | None:
    """Why this child process does not see the tree under test alone, or None."""
    import sglang
    from sglang.srt.plugins import load_plugins

    from sglang_dsv4 import plugin

    tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    if not tree or not sglang.__file__.startswith(tree):
        return f"sglang was imported from {sglang.__file__}, not from the tree {tree}"
    load_plugins()
    if plugin.STATE:
        return "the dsv4_sm120 plugin ran although SGLANG_PLUGINS excludes it"
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- child processes on the tree ----------------------------------------------------------------


def _env(python_dir: Path, plugin: bool, skip: list[str] = ()) -> dict[str, str]:
    env = dict(os.environ)
    ours = [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
    env["PYTHONPATH"] = os.pathsep.join([str(python_dir), *ours])
    env.pop("SGLANG_DSV4_SKIP_FIXES", None)
    env["PYTHONUNBUFFERED"] = "1"  # every outcome line reaches the pipe, even if a test crashes
    if plugin:
        env.pop("SGLANG_PLUGINS", None)
        # The tree is not the pin by design here; its version is what is being judged.
        env["SGLANG_DSV4_ALLOW_UNPINNED"] = "1"
        if skip:
            env["SGLANG_DSV4_SKIP_FIXES"] = ",".join(skip)
    else:
        env["SGLANG_PLUGINS"] = NO_PLUGIN
    return env


def run_probe(python_dir: Path, modules: list[str]) -> dict[str, Reason | None]:
    # A fresh interpreter that imports the tree alone (warm: torch and the like already loaded).
    argv = ["-m", "sglang_dsv4.maintain.rebase_check", "--probe", *modules]
    proc = warm_python.run(argv, env=_env(python_dir, plugin=False), cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        reason = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RebaseCheckError(f"the probe on {python_dir} failed: {reason[0]}")
    return {module: Reason.from_json(found) for module, found in json.loads(lines[-1]).items()}


# "test/behaviour/test_x.py::test_y[fp8] PASSED [ 10%]" as pytest -v prints each outcome.
# (Parameter ids may hold spaces.)
_OUTCOME = re.compile(r"^(test/\S+?\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_STARTED = re.compile(r"^(test/\S+?\.py::.+?) *$")


def run_tests(python_dir: Path, files: list[str], plugin: bool, skip: list[str], out: Path):
    """Run behaviour test files on a tree; returns {file: {"passed": [...], "failed": [...]}}.

    Outcomes are read from pytest's verbose lines, so a test that kills the interpreter (an
    abort on a tree without the fix) fails with its file; the other files run on.
    """
    outcomes: dict[str, str] = {}  # node id -> "passed" | "skipped" | why it failed
    crashed: set[str] = set()  # files whose remaining tests did not run
    log = []
    while remaining := [f for f in files if f not in crashed]:
        # A fresh interpreter for each run, forked warm (torch and the other third-party
        # imports done once): the tree's sglang is imported anew from PYTHONPATH.
        # -n 0: one process, whatever the project's addopts say (outcomes are read in order).
        cmd = ["-m", "pytest", "-v", "--no-header", "-p", "no:cacheprovider", "-n", "0"]
        # --durations: each delivery's log says which test took how long (and, from the
        # project's conftest, which waited idle).
        cmd += ["--durations=30", "--durations-min=1.0"]
        cmd += [*remaining, *(f"--deselect={node}" for node in outcomes)]
        proc = warm_python.run(cmd, env=_env(python_dir, plugin, skip), cwd=REPO_ROOT)
        log.append(proc.stdout + proc.stderr)
        last = None  # the test running when the output ended
        for line in proc.stdout.splitlines():
            if m := _OUTCOME.match(line):
                node, result = m.groups()
                if result in ("FAILED", "ERROR"):
                    outcomes[node] = result.lower()
                elif result in ("PASSED", "XFAIL"):
                    outcomes.setdefault(node, "passed")
                else:
                    outcomes.setdefault(node, "skipped")
                last = node
            elif m := _STARTED.match(line):
                last = m.group(1)
        if proc.returncode >= 0 or last is None:
            break
        # Killed by a signal while running (or tearing down) `last`: it fails, the rest resume.
        fatal = next(
            (line for line in proc.stderr.splitlines() if "Fatal Python error" in line),
            f"killed by signal {-proc.returncode}",
        )
        outcomes[last] = f"crashed the interpreter{fatal.split('Fatal Python error')[-1]}"
        crashed.add(last.partition("::")[0])
    out.with_suffix(".log").write_text("\n".join(log))
    results = {f: {"passed": [], "failed": []} for f in files}
    for node, outcome in outcomes.items():
        file, _, name = node.partition("::")
        if file in results and outcome != "skipped":
            key = "passed" if outcome == "passed" else "failed"
            results[file][key].append(name if key == "passed" else f"{name} ({outcome})")
    for f in files:
        if not results[f]["passed"] and not results[f]["failed"]:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            results[f]["failed"].append(f"no test ran ({tail[0][:160]})")
    return results


def read_junit(junit: Path, files: list[str], out: Path):
    """The plugin delivery's outcomes, read from a JUnit XML report of a pytest run that already
    ran these files with the plugin on the same upstream release (the README's test command, in
    CI), in `run_tests`' shape: the same tests are not run twice. Every file must be in it."""
    import xml.etree.ElementTree as ElementTree

    try:
        root = ElementTree.parse(junit).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        raise RebaseCheckError(f"--plugin-results {junit}: {_one_line(exc)}") from exc
    results = {f: {"passed": [], "failed": []} for f in files}
    lines = [f"plugin delivery: outcomes read from {junit}, not run again"]
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname "test.behaviour.test_x" (or "...test_x.TestClass"): the longest prefix that
        # names one of the files; what follows it is the class.
        n = next((n for n in range(len(module), 0, -1) if _as_file(module[:n]) in results), 0)
        if not n:
            continue
        file, within = _as_file(module[:n]), ".".join(module[n:])
        name = f"{within}::{case.get('name')}" if within else case.get("name")
        failure = next((c.tag for c in case if c.tag in ("failure", "error")), None)
        if failure:
            results[file]["failed"].append(
                f"{name} ({'failed' if failure == 'failure' else 'error'})"
            )
            lines.append(f"{file}::{name} FAILED")
        elif not any(c.tag == "skipped" for c in case):
            results[file]["passed"].append(name)
            lines.append(f"{file}::{name} PASSED")
    missing = [f for f in files if not results[f]["passed"] and not results[f]["failed"]]
    if missing:
        raise RebaseCheckError(
            f"--plugin-results {junit} holds no outcome of {', '.join(missing)}: run the tests "
            "with the plugin there, or leave the option out"
        )
    out.with_suffix(".log").write_text("\n".join(lines) + "\n")
    return results


def _as_file(parts: list[str]) -> str:
    return "/".join(parts) + ".py"


def _installed_upstream_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


# --- patches on a copy of the tree --------------------------------------------------------------


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=git_env())


def _hunk(stderr: str) -> str:
    """The first place git apply names, e.g. 'python/sglang/srt/x.py:120 does not apply'."""
    for line in stderr.splitlines():
        m = re.match(r"error: patch failed: (\S+):(\d+)", line)
        if m:
            return f"hunk at {m.group(1)}:{m.group(2)} does not apply"
    for line in stderr.splitlines():
        if line.startswith("error:"):
            return line.removeprefix("error:").strip()
    return stderr.strip().splitlines()[-1] if stderr.strip() else "git apply failed"


def apply_patches(facts: list[FixFacts], patch_dir: Path, repo: Path) -> None:
    """Apply each fix's patches in series order where they apply; record what does not."""
    for fact in facts:
        for name in fact.patches:
            patch = str((patch_dir / name).resolve())
            if _git(["apply", "--check", "--reverse", patch], repo).returncode == 0:
                fact.already_applied.append(name)
                continue
            check = _git(["apply", "--check", patch], repo)
            if check.returncode:
                fact.not_applying.append(f"{name}: {_hunk(check.stderr)}")
                continue
            applied = _git(["apply", patch], repo)
            if applied.returncode:
                fact.not_applying.append(f"{name}: {_hunk(applied.stderr)}")


# --- verdicts -----------------------------------------------------------------------------------


def removal(fix, module: str) -> list[str]:
    return [
        "python/" + module.replace(".", "/") + ".py",
        f"its entry in python/sglang_dsv4/fixes/__init__.py ({fix.id})",
        *fix.tests,
    ]


def _failures(result: dict[str, list[str]], files: tuple[str, ...]) -> list[str]:
    return [f"{f}::{name}" for f in files for name in result.get(f, {}).get("failed", [])]


def decide(fix, fact: FixFacts, version: str, tests_run: bool) -> Verdict:
    delete = removal(fix, fact.module)
    retire = (
        f"; register says upstream={fix.upstream!r}: set it to 'upstream since {version}' "
        f"and delete the fix (Remove when: {fix.remove_when})"
    )
    if fact.patches and len(fact.already_applied) == len(fact.patches):
        evidence = (
            f"{', '.join(fact.already_applied)} already applied to the tree (reverse-applies)"
        )
        return Verdict(fix.id, ALREADY, evidence + retire, delete)
    if fact.precheck and fact.precheck.upstream_has_it:
        return Verdict(fix.id, ALREADY, fact.precheck.text + retire, delete)
    if fact.precheck:
        return Verdict(fix.id, BROKEN, fact.precheck.text)
    if fact.not_applying:
        return Verdict(fix.id, BROKEN, "patch " + fact.not_applying[0])
    if not tests_run:
        return Verdict(
            fix.id, NEEDED, "patch applies, targets and signatures match (tests not run)"
        )
    pristine = _failures(fact.results.get("pristine", {}), fix.tests)
    if not pristine:
        evidence = f"{', '.join(fix.tests)} pass on the pristine tree without the plugin"
        return Verdict(fix.id, ALREADY, evidence + retire, delete)
    for delivery, label in (("patched", "with the patch series"), ("plugin", "with the plugin")):
        failed = _failures(fact.results.get(delivery, {}), fix.tests)
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            return Verdict(fix.id, BROKEN, f"{failed[0]} fails {label}{more}")
    return Verdict(
        fix.id,
        NEEDED,
        f"patch applies; {len(pristine)} test(s) fail on the pristine tree (e.g. {pristine[0]}), "
        "all pass with the series and with the plugin",
    )


class RebaseCheckError(Exception):
    """rebase-check cannot judge the tree; the message is one line."""


@dataclass
class Series:
    """The patch series as maintained: exported from the register against the pinned release."""

    directory: Path
    patches: dict[str, list[str]]  # fix id -> its patch files, in series order


def export_pinned_series(directory: Path) -> Series:
    fixes = [fix for fix, _ in register()]
    outcomes = export.export_series(fixes, upstream.fetch_pinned_upstream(), directory)
    return Series(directory, {o.fix.id: list(o.patches) for o in outcomes})


def check(
    python_dir: Path,
    only: list[str] | None = None,
    tests: bool = True,
    series: Series | None = None,
    logs: Path | None = None,
    plugin_results: Path | None = None,
    seconds: dict[str, float] | None = None,
) -> tuple[str, list[Verdict]]:
    """The tree's version and one verdict per fix (register order, or the ids in `only`).
    With `logs`, each delivery's pytest output is kept there (`<delivery>.log`). With
    `plugin_results` (JUnit XML of the behaviour tests already run with the plugin installed on
    this same release), the plugin delivery reads its outcomes from there instead of running
    the tests again; it must be the installed release, and no fix may be left out. `seconds`
    receives each delivery's wall-clock seconds, for CI's phase table."""
    version = upstream.tree_version(python_dir)
    installed = _installed_upstream_version()
    if plugin_results is not None and installed != version:
        raise RebaseCheckError(
            f"--plugin-results: the tests there ran on the installed sglang {installed}, "
            f"not on the tree's {version}"
        )
    fixes = register()
    known = {fix.id for fix, _ in fixes}
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise RebaseCheckError(f"no fix with id {', '.join(unknown)}; known: {', '.join(known)}")
    with tempfile.TemporaryDirectory(prefix="sglang-dsv4-rebase-") as tmp:
        work = Path(tmp)
        series = series or export_pinned_series(work / "patches")
        patch_dir = series.directory
        facts = [
            FixFacts(fix.id, module, tuple(fix.tests), series.patches[fix.id])
            for fix, module in fixes
        ]
        repo = work / "tree"
        shutil.copytree(
            python_dir / "sglang",
            repo / "python" / "sglang",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        # git apply needs a work tree, not history: no commit of the whole tree.
        upstream.git(["init", "--quiet"], repo)
        apply_patches(facts, patch_dir, repo)
        reasons = run_probe(python_dir, [f.module for f in facts])
        for fact in facts:
            fact.precheck = reasons[fact.module]
        chosen = [f for f in facts if not only or f.id in only]
        unfit = [f.id for f in facts if f.precheck or f.not_applying or f.already_applied]
        # Tests decide only between needed and already upstream: a fix judged from its targets
        # and patch (broken, or its patch already applied) needs no test run.
        files = [t for f in chosen if f.id not in unfit for t in f.tests]
        if tests and files and plugin_results is not None and unfit:
            # That run applied every fix; the plugin delivery here must leave some out.
            raise RebaseCheckError(
                f"--plugin-results: {', '.join(unfit)} cannot be judged by tests here, so the "
                "plugin delivery must run without them; leave the option out"
            )
        if tests and files:
            deliveries = {
                "pristine": (python_dir, False),
                "patched": (repo / "python", False),
                "plugin": (python_dir, True),
            }
            for delivery, (tree, plugin) in deliveries.items():
                started = time.monotonic()
                if delivery == "plugin" and plugin_results is not None:
                    result = read_junit(plugin_results, files, work / delivery)
                else:
                    result = run_tests(tree, files, plugin, unfit, work / delivery)
                if seconds is not None:
                    seconds[delivery] = round(time.monotonic() - started, 1)
                if logs is not None:
                    logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(work / f"{delivery}.log", logs / f"{delivery}.log")
                for fact in chosen:
                    fact.results[delivery] = {t: result[t] for t in fact.tests if t in result}
        by_id = {fix.id: fix for fix, _ in fixes}
        verdicts = [decide(by_id[f.id], f, version, tests) for f in chosen]
    return version, verdicts


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--version", help="an upstream release, fetched from the package index (wheel, cached)"
    )
    where.add_argument(
        "--upstream-src",
        type=Path,
        help="an upstream tree: a checkout laid out as upstream's repository, or its python/",
    )
    parser.add_argument("--fix", action="append", metavar="ID", help="only this fix (repeatable)")
    parser.add_argument(
        "--no-tests",
        action="store_true",
        help="judge from targets and patches only; do not run the behaviour tests",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--logs",
        type=Path,
        metavar="DIR",
        help="keep each delivery's pytest output in DIR (pristine.log, patched.log, plugin.log)",
    )
    parser.add_argument(
        "--plugin-results",
        type=Path,
        metavar="JUNIT_XML",
        help="the plugin delivery's outcomes from this pytest JUnit XML report of a run with "
        "the plugin installed on the same release (CI: the test command's), instead of "
        "running the behaviour tests a third time",
    )


def run(args) -> int:
    try:
        if args.version:
            python_dir = upstream.fetch_upstream(args.version)
        else:
            python_dir = upstream.python_dir_of(args.upstream_src)
        seconds: dict[str, float] = {}
        version, verdicts = check(
            python_dir,
            args.fix,
            tests=not args.no_tests,
            logs=args.logs,
            plugin_results=args.plugin_results,
            seconds=seconds,
        )
    except (upstream.ExportError, RebaseCheckError) as exc:
        print(f"sglang-dsv4 rebase-check: error: {exc}", file=sys.stderr)
        return 2
    ok = all(v.verdict in (NEEDED, ALREADY) for v in verdicts)
    if args.json:
        report = {
            "upstream": {"version": version, "python_dir": str(python_dir)},
            "pin": UPSTREAM_PIN,
            "tests_run": not args.no_tests,
            "ok": ok,
            "fixes": [asdict(v) for v in verdicts],
            # each delivery's wall-clock seconds (the plugin's: reading its report, with
            # --plugin-results)
            "seconds": seconds,
        }
        print(json.dumps(report, indent=2))
    else:
        print(
            f"upstream sglang {version} ({python_dir}); the distribution is pinned to {UPSTREAM_PIN}"
        )
        width = max(len(v.id) for v in verdicts)
        for v in verdicts:
            print(f"{v.id:<{width}}  {v.verdict:<16}  {v.evidence}")
            if v.remove:
                print(f"{'':<{width}}  {'':<16}  delete: {'; '.join(v.remove)}")
        print("ok" if ok else "not ok: a fix is broken on this tree")
    return 0 if ok else 1


def _probe_main(modules: list[str]) -> int:
    try:
        found = probe(modules)
        print(json.dumps({m: r.as_json() if r else None for m, r in found.items()}))
    except RebaseCheckError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        sys.exit(_probe_main(sys.argv[2:]))
    sys.exit("usage: sglang-dsv4 rebase-check (--version X | --upstream-src DIR) [--json]")
