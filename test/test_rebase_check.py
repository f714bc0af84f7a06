"""`sglang-dsv4 rebase-check` on real upstream trees: the pinned release, the release before it
(fetched from the package index), and copies of the pinned release changed here.

The behaviour tests of every fix on the pinned release run in CI (`.ci/run`, the full command);
here the verdicts come from targets and patches (`tests=False`), which is what changes between
the trees below.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from sglang_dsv4 import warm_python
from sglang_dsv4.maintain import rebase_check, upstream
from sglang_dsv4.maintain.rebase_check import ALREADY, BROKEN, NEEDED

REPO = Path(__file__).resolve().parents[1]
PREVIOUS_RELEASE = "0.5.22"


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> rebase_check.Series:
    return rebase_check.export_pinned_series(tmp_path_factory.mktemp("series"))


@pytest.fixture(scope="module")
def pinned() -> Path:
    return upstream.upstream_python_dir(None)


def copy_tree(python_dir: Path, dest: Path) -> Path:
    shutil.copytree(
        python_dir / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def verdicts_of(python_dir: Path, series) -> dict[str, rebase_check.Verdict]:
    _, verdicts = rebase_check.check(python_dir, tests=False, series=series)
    return {v.id: v for v in verdicts}


def test_every_fix_is_needed_on_the_pinned_release(pinned, series):
    verdicts = verdicts_of(pinned, series)
    assert [v.id for v in verdicts.values()] == [fix.id for fix, _ in rebase_check.register()]
    assert {v.verdict for v in verdicts.values()} == {NEEDED}, verdicts


def test_a_fix_whose_patch_is_applied_is_already_upstream_and_only_that_one(
    pinned, series, tmp_path
):
    fix_id = "host-mirror-geometry"
    tree = copy_tree(pinned, tmp_path / "python")
    for name in series.patches[fix_id]:
        subprocess.run(["git", "apply", "-p2", str(series.directory / name)], cwd=tree, check=True)

    verdicts = verdicts_of(tree, series)

    assert verdicts[fix_id].verdict == ALREADY
    assert "already applied" in verdicts[fix_id].evidence
    assert "python/sglang_dsv4/fixes/host_mirror_geometry.py" in verdicts[fix_id].remove
    others = {fid: v.verdict for fid, v in verdicts.items() if fid != fix_id}
    assert set(others.values()) == {NEEDED}, others


def test_a_changed_signature_is_broken_and_named(pinned, series, tmp_path):
    tree = copy_tree(pinned, tmp_path / "python")
    pool = tree / "sglang/srt/mem_cache/deepseek_v4_memory_pool.py"
    text = pool.read_text()
    old = "use_fp4_indexer: bool) -> int:"
    assert text.count(old) == 1
    pool.write_text(text.replace(old, "use_fp4_indexer: bool, page_size=256) -> int:"))

    verdicts = verdicts_of(tree, series)

    target = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
    assert verdicts["pool-sizing-bf16"].verdict == BROKEN
    evidence = verdicts["pool-sizing-bf16"].evidence
    assert f"{target}.get_dsv4_indexer_bytes_per_token" in evidence and "page_size=256" in evidence


def test_a_hunk_that_does_not_apply_is_broken_and_named(pinned, series, tmp_path):
    tree = copy_tree(pinned, tmp_path / "python")
    # Change a line the pool-sizing patch removes, so its hunk no longer matches.
    configurator = tree / "sglang/srt/model_executor/pool_configurator.py"
    patch = (series.directory / series.patches["pool-sizing-bf16"][-1]).read_text()
    section = patch.split("+++ b/python/sglang/srt/model_executor/pool_configurator.py", 1)[1]
    removed = next(
        line[1:] for line in section.splitlines() if line.startswith("-") and line[1:].strip()
    )
    text = configurator.read_text()
    assert text.count(removed) >= 1
    configurator.write_text(text.replace(removed, removed + "  # changed upstream", 1))

    verdicts = verdicts_of(tree, series)

    assert verdicts["pool-sizing-bf16"].verdict == BROKEN
    assert re.search(
        r"hunk at python/sglang/srt/model_executor/pool_configurator\.py:\d+ does not apply",
        verdicts["pool-sizing-bf16"].evidence,
    )


def _parameter_names(signature: str) -> list[str]:
    args = ast.parse(f"def f{signature}: pass").body[0].args
    every = args.posonlyargs + args.args + args.kwonlyargs
    every += [a for a in (args.vararg, args.kwarg) if a]
    return [a.arg for a in every]


def _upstream_parameter_names(python_dir: Path, target: str) -> list[str] | None:
    """The parameter names of `target` as the tree's source defines it, or None if absent."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        file = python_dir / ("/".join(parts[:cut]) + ".py")
        if file.is_file():
            break
    else:
        return None
    body = ast.parse(file.read_text()).body
    node = None
    for name in parts[cut:]:
        node = next(
            (
                n
                for n in body
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == name
            ),
            None,
        )
        if node is None:
            return None
        body = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return _parameter_names(ast.unparse(node.args).join("()"))


def test_previous_release_verdicts_follow_its_source(series, capsys):
    try:
        previous = upstream.fetch_upstream(PREVIOUS_RELEASE)
    except upstream.ExportError as exc:
        pytest.fail(str(exc))  # CI reaches the package index; without it this proof cannot run

    assert rebase_check.register()  # the pin's register, read in this process
    # The command's own parser, so every option it has takes its default.
    parser = argparse.ArgumentParser()
    rebase_check.add_arguments(parser)
    args = parser.parse_args(["--version", PREVIOUS_RELEASE, "--no-tests", "--json"])
    code = rebase_check.run(args)
    report = json.loads(capsys.readouterr().out)
    assert report["upstream"]["version"] == PREVIOUS_RELEASE
    verdicts = {f["id"]: f for f in report["fixes"]}

    for fix, _ in rebase_check.register():
        moved = [
            r.target
            for r in fix.replaces
            if _upstream_parameter_names(previous, r.target) != _parameter_names(r.signature)
        ]
        if moved:  # a target the fix replaces is absent or takes other parameters there
            assert verdicts[fix.id]["verdict"] == BROKEN, (fix.id, moved)
        assert verdicts[fix.id]["evidence"]
    broken = [v for v in verdicts.values() if v["verdict"] == BROKEN]
    assert report["ok"] == (not broken)
    assert code == (1 if broken else 0)


def test_every_behaviour_test_file_belongs_to_exactly_one_fix():
    owners: dict[str, list[str]] = {}
    for fix, _ in rebase_check.register():
        assert fix.tests, f"{fix.id} names no behaviour tests"
        for path in fix.tests:
            assert (REPO / path).is_file(), f"{fix.id}: {path} does not exist"
            owners.setdefault(path, []).append(fix.id)
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "test/behaviour").glob("test_*.py"))
    assert files == sorted(owners), "every behaviour test file is named by one fix's register entry"
    assert all(len(ids) == 1 for ids in owners.values()), owners


def test_unknown_fix_and_missing_tree_are_one_line_errors(tmp_path, capsys):
    proc = warm_python.run(["-m", "sglang_dsv4", "rebase-check", "--upstream-src", str(tmp_path)],
                           cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("sglang-dsv4 rebase-check: error: ")
    assert "holds no upstream sglang source" in proc.stderr

    with pytest.raises(rebase_check.RebaseCheckError, match="no fix with id not-a-fix"):
        rebase_check.check(upstream.fetch_pinned_upstream(), only=["not-a-fix"], tests=False)


def test_a_tree_that_defines_what_a_fix_adds_is_already_upstream(pinned, series, tmp_path):
    # Upstream "merged" the byte rule: the pool module defines the function index-k-bf16 adds.
    tree = copy_tree(pinned, tmp_path / "python")
    pool = tree / "sglang/srt/mem_cache/deepseek_v4_memory_pool.py"
    pool.write_text(
        pool.read_text() + "\n\ndef dsv4_index_k_bytes_per_token(index_head_dim, index_k_dtype):\n"
        "    return 2 * index_head_dim\n"
    )
    verdict = verdicts_of(tree, series)["index-k-bf16"]
    assert verdict.verdict == ALREADY, verdict
    assert verdict.evidence.startswith(
        "target sglang.srt.mem_cache.deepseek_v4_memory_pool.dsv4_index_k_bytes_per_token: "
        "upstream now defines it"
    )
    assert verdict.remove


def test_already_upstream_is_decided_by_the_kind_of_reason_not_its_words():
    from sglang_dsv4.hooks import Problem, Reason

    fix = next(fix for fix, _ in rebase_check.register() if fix.id == "index-k-bf16")
    words = "target x.y: upstream now defines it; is the fix upstream?"
    for problem, expected in ((Problem.UPSTREAM_DEFINES, ALREADY), (Problem.NOT_FOUND, BROKEN)):
        fact = rebase_check.FixFacts(fix.id, "m", fix.tests, ["p.patch"])
        fact.precheck = Reason(problem, words)
        assert rebase_check.decide(fix, fact, "9.9.9", tests_run=False).verdict == expected


@pytest.mark.parametrize("skip", [[], ["pool-sizing-bf16"]], ids=["all fixes", "fix skipped"])
def test_plugin_results_read_from_junit_are_what_the_plugin_delivery_runs(pinned, tmp_path, skip):
    """CI's test command already ran the behaviour tests with the plugin on the pin; rebase-check
    reads the plugin delivery from its JUnit report instead of running them a third time. Both
    readings of the same real run agree, passes and failures alike (a skipped fix fails its
    tests here), and a report that lacks a file, or a tree that is not the installed release,
    is refused with one line."""
    file = "test/behaviour/test_pool_sizing.py"
    env = rebase_check._env(pinned, plugin=True, skip=skip)
    junit = tmp_path / "tests.xml"
    warm_python.run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", file, f"--junitxml={junit}"],
                    env=env, cwd=REPO)
    read = rebase_check.read_junit(junit, [file], tmp_path / "read")
    ran = rebase_check.run_tests(pinned, [file], True, skip, tmp_path / "ran")
    assert read == ran
    assert bool(read[file]["failed"]) == bool(skip), read
    assert read[file]["passed"] or read[file]["failed"]
    with pytest.raises(rebase_check.RebaseCheckError, match="holds no outcome of test/behaviour/x"):
        rebase_check.read_junit(junit, [file, "test/behaviour/x.py"], tmp_path / "missing")


def test_plugin_results_of_another_release_are_refused(tmp_path):
    previous = upstream.fetch_upstream(PREVIOUS_RELEASE)
    with pytest.raises(rebase_check.RebaseCheckError, match="installed sglang 0.5.23, not"):
        rebase_check.check(previous, tests=True, plugin_results=tmp_path / "tests.xml")
