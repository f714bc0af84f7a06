"""`sglang-dsv4 export-patches`: the patch series generated from the register.

Two kinds of upstream tree:
- a tiny synthetic one (python/sglang/... with modules written here, not upstream's), with toy
  fixes written here, so that every rule of the mechanism is tested whatever fixes exist;
- the pinned release itself (the wheel `pip download` fetches, cached), with the distribution's own
  FIXES: every implemented fix is exported, applied with `git am` and compared with its functions.
Real git, ruff and libcst throughout; patched toy trees are imported in a child process.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_dsv4 import UPSTREAM_PIN, cli
from sglang_dsv4.fix import Add, Fix, Replace
from sglang_dsv4.maintain import export, formatting, upstream

TOY = "sglang.srt.dsv4_export_toy"
MESSY = "sglang.srt.dsv4_export_messy"

TOY_SOURCE = '''\
"""A small module standing in for an upstream one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections import OrderedDict

SCALE = 2


def area(width, height):
    return width * height * SCALE


class Ring:
    unit = "m"

    def __init__(self, radius):
        self.radius = radius

    def length(self, turns):
        return 2 * math.pi * self.radius * turns

    @staticmethod
    def describe(value):
        return f"ring {value}"

    @classmethod
    def unit_ring(cls):
        return cls(1)


def main():
    print(area(1, 2))


if __name__ == "__main__":
    main()
'''

# Not formatted the way black would: the series must leave all of it alone but what it replaces.
MESSY_SOURCE = """\
WEIGHTS = [1,2,
    3]

def total( values ):
    return sum( values )
"""

FIX_SOURCE = '''\
"""Toy fixes for the toy upstream module."""

import functools
import math

from dsv4_toy_kernels.ops import triple
from sglang.srt.dsv4_export_toy import SCALE, Ring


def ring_length(self, turns):
    """Length of `turns` turns, in millimetres.

    A second docstring line, which the patch indents with the method.
    """
    return round(2 * math.pi * self.radius * turns * 1000)


def describe(value):
    return f"ring of {value} {Ring.unit}"


def unit_ring(cls):
    return cls(SCALE)


@functools.lru_cache(maxsize=1)
def ring_table():
    return tuple(Ring(r).length(1) for r in range(3))


def ring_area(self):
    return math.pi * self.radius**2


class RingExtras:
    def label(self):
        """The ring's label.

        Written as a method here; its strings must reach the patch unchanged.
        """
        banner = """ring
  of radius """
        return banner + str(self.radius)


def area(width, height):
    return triple(width * height)


def total(values):
    return sum(value * WEIGHTS_OF_TOTAL for value in values) + len([v for v in values if v > 0])


def uses_unknown(self, turns):
    return not_bound_anywhere(turns)


class Ring2:
    pass


def uses_other_ring():
    return Ring2


def calls_super(self, radius):
    super().__init__(radius)
'''

KERNEL_OPS = '''\
"""Toy kernel of the distribution."""

from .reference import double


def triple(x):
    return double(x) + x
'''

KERNEL_REFERENCE = """\
def double(x):
    return 2 * x
"""


def write_tree(root: Path, modules: dict[str, str], version: str = UPSTREAM_PIN) -> Path:
    """A synthetic upstream tree laid out as upstream's repository; returns its python/ dir."""
    python = root / "python"
    (python / "sglang" / "srt").mkdir(parents=True)
    (python / "sglang" / "__init__.py").write_text("")
    (python / "sglang" / "srt" / "__init__.py").write_text("")
    (python / "sglang" / "_version.py").write_text(f"__version__ = version = {version!r}\n")
    for module, source in modules.items():
        (python / (module.replace(".", "/") + ".py")).write_text(source)
    return python


def load(name: str, path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def toy_fix(fix_id: str, **fields) -> Fix:
    base = dict(
        id=fix_id,
        title=f"toy change {fix_id}",
        area="toy",
        why="The toy ring rounds nothing; callers want millimetres.",
        how="Replace Ring.length and friends with versions that say what they compute.",
        upstream="not upstream",
        remove_when="the toy upstream does it itself.",
        targets=(f"{TOY}.Ring",),
    )
    base.update(fields)
    return Fix(**base)


class Toy:
    """The synthetic upstream tree, its modules (imported here as upstream), the toy fixes."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp = tmp_path
        self.python = write_tree(tmp_path / "upstream", {TOY: TOY_SOURCE, MESSY: MESSY_SOURCE})
        kernels = tmp_path / "dist" / "dsv4_toy_kernels"
        kernels.mkdir(parents=True)
        (kernels / "__init__.py").write_text("")
        (kernels / "ops.py").write_text(KERNEL_OPS)
        (kernels / "reference.py").write_text(KERNEL_REFERENCE)
        monkeypatch.syspath_prepend(str(tmp_path / "dist"))
        for name in [n for n in sys.modules if n.startswith("dsv4_toy_kernels")]:
            monkeypatch.delitem(sys.modules, name)
        # the toy kernels count as a package of the distribution (carried, never imported)
        monkeypatch.setattr(
            export, "DISTRIBUTION_PACKAGES", (*export.DISTRIBUTION_PACKAGES, "dsv4_toy_kernels")
        )
        self.upstream = load(TOY, self.python / "sglang/srt/dsv4_export_toy.py", monkeypatch)
        self.messy = load(MESSY, self.python / "sglang/srt/dsv4_export_messy.py", monkeypatch)
        (tmp_path / "dsv4_toy_fix.py").write_text(FIX_SOURCE)
        self.fix = load("dsv4_toy_fix", tmp_path / "dsv4_toy_fix.py", monkeypatch)
        for name in [n for n in sys.modules if n.startswith("dsv4_toy_kernels")]:
            monkeypatch.setitem(sys.modules, name, sys.modules[name])  # dropped after the test

    def main_fix(self) -> Fix:
        f = self.fix
        return toy_fix(
            "toy-rings",
            replaces=(
                Replace(f"{TOY}.Ring.length", f.ring_length, "(self, turns)"),
                Replace(f"{TOY}.Ring.describe", f.describe, "(value)"),
                Replace(f"{TOY}.Ring.unit_ring", f.unit_ring, "(cls)"),
                Replace(f"{TOY}.area", f.area, "(width, height)"),
            ),
            adds=(
                Add(TOY, f.ring_table),
                Add(f"{TOY}.Ring", f.ring_area),
                Add(f"{TOY}.Ring", f.RingExtras.label),
            ),
            imports={TOY: ("import functools", "from dsv4_toy_kernels.ops import triple")},
            new_files={
                "sglang.srt.dsv4_toy_ops": "dsv4_toy_kernels.ops",
                "sglang.srt.dsv4_toy_reference": "dsv4_toy_kernels.reference",
            },
        )

    def export(self, fixes, out: str = "patches"):
        return export.export_series(fixes, self.python, self.tmp / out)

    def apply(self, out: str = "patches") -> Path:
        dest = self.tmp / f"applied-{out}"
        export.apply_series(self.tmp / out, self.python, dest)
        return dest / "python"


@pytest.fixture
def toy(tmp_path, monkeypatch):
    return Toy(tmp_path, monkeypatch)


def run_in_tree(python_dir: Path, code: str) -> dict:
    """Run `code` in a child process with `python_dir` as the only source of `sglang`."""
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(python_dir)!r})\n{code}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def patch_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def defs_by_qualname(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    found = {}

    def walk(statements, prefix):
        for node in statements:
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[prefix + node.name] = node

    walk(tree.body, "")
    return found


def comparable(node: ast.FunctionDef) -> str:
    """A def as code, docstring indentation normalised and without the method-kind decorator
    (formatting and re-indentation are the only changes the export may make)."""
    node = ast.parse(ast.unparse(node)).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body[0].value.value = inspect.cleandoc(body[0].value.value)
    node.decorator_list = [
        d for d in node.decorator_list if ast.unparse(d) not in ("staticmethod", "classmethod")
    ]
    node.name = "_"
    return ast.dump(node)


def source_def(func) -> ast.FunctionDef:
    """The def of `func` as its file has it (a method parses under `if True:`, strings intact)."""
    source = inspect.getsource(inspect.unwrap(getattr(func, "__func__", func)))
    if source[:1].isspace():
        return ast.parse("if True:\n" + source).body[0].body[0]
    return ast.parse(source).body[0]


# --- the mechanism, on the synthetic tree -------------------------------------------------------


def test_toy_series_has_git_format_patch_shape(toy):
    declared = toy_fix("toy-declared")
    upstreamed = toy_fix(
        "toy-upstreamed",
        upstream="upstream since 0.5.20",
        replaces=(Replace(f"{TOY}.Ring.length", toy.fix.ring_length, "(self, turns)"),),
    )
    fix = toy.main_fix()
    outcomes = toy.export([declared, fix, upstreamed])

    assert [len(o.patches) for o in outcomes] == [0, 2, 0]
    assert "declared, not implemented" in outcomes[0].note
    assert "already upstream" in outcomes[2].note
    out = toy.tmp / "patches"
    kernels, name = outcomes[1].patches
    assert name == outcomes[1].patch
    assert (out / "series").read_text() == f"{kernels}\n{name}\n"
    assert sorted(p.name for p in out.iterdir()) == sorted([kernels, name, "series"])
    # the new files (kernels) first, on their own, as a reviewer takes them
    kernel_text = (out / kernels).read_text()
    assert f"Subject: [PATCH 1/2] {fix.area}: kernels for {fix.title}" in kernel_text
    touched = re.findall(r"^diff --git a/(\S+)", kernel_text, flags=re.M)
    assert touched and all(
        path.removeprefix("python/").removesuffix(".py").replace("/", ".") in fix.new_files
        for path in touched
    )
    assert "\nOrigin: " in kernel_text and "\nRemove-When: " in kernel_text
    text = (out / name).read_text()
    assert "new file mode" not in text
    lines = text.splitlines()
    assert lines[0] == "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"
    assert lines[1] == f"From: {upstream.AUTHOR_NAME} <{upstream.AUTHOR_EMAIL}>"
    assert lines[2].startswith("Date: ") and "2026" in lines[2]
    assert lines[3] == f"Subject: [PATCH 2/2] {fix.area}: {fix.title}"
    for field in ("Why: ", "How: ", "Origin: ", "Forwarded: no", "Applied-Upstream: no"):
        assert f"\n{field}" in text
    assert "\nRemove-When: the toy upstream does it itself." in text
    assert f"\nLast-Update: {export.LAST_UPDATE}" in text
    assert not text.rstrip().endswith(tuple("0123456789")), "no git version signature"
    assert "\n-- \n" not in text
    # full blob ids: the series carries what a 3-way merge needs
    assert all(
        len(line.split()[1].split("..")[0]) == 40 for line in lines if line.startswith("index ")
    )


def test_toy_series_writes_the_functions_where_they_belong(toy):
    fix = toy.main_fix()
    toy.export([fix])
    patched_dir = toy.apply()
    patched = (patched_dir / "sglang/srt/dsv4_export_toy.py").read_text()
    tree = ast.parse(patched)
    defs = defs_by_qualname(tree)

    # every replacement and addition stands where the register says, as its own source
    for rep in fix.replaces:
        qualname = rep.target.removeprefix(TOY + ".")
        assert comparable(defs[qualname]) == comparable(source_def(rep.func)), qualname
    for add in fix.adds:
        qualname = add.target.removeprefix(TOY + ".")
        assert comparable(defs[qualname]) == comparable(source_def(add.func)), qualname

    # kinds of the originals are kept; our decorators too
    ring = defs["Ring.describe"], defs["Ring.unit_ring"], defs["ring_table"]
    assert [ast.unparse(d) for d in ring[0].decorator_list] == ["staticmethod"]
    assert [ast.unparse(d) for d in ring[1].decorator_list] == ["classmethod"]
    assert [ast.unparse(d) for d in ring[2].decorator_list] == ["functools.lru_cache(maxsize=1)"]
    # module-level addition right after the last definition it uses (Ring); method at class end
    top = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert top == ["area", "Ring", "ring_table", "main"]
    ring_class = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    assert [n.name for n in ring_class.body[-2:]] == ["ring_area", "label"]
    # the docstring follows the method's indentation; imports sorted into upstream's block
    assert (
        "\n        A second docstring line, which the patch indents with the method.\n" in patched
    )
    assert "import functools\nimport math\n" in patched
    assert "from sglang.srt.dsv4_toy_ops import triple" in patched
    assert "dsv4_toy_kernels" not in patched
    # formatted as upstream formats: ruff (black style, 88 columns) finds nothing to change
    formatted = formatting._ruff(["format", "--line-length=88"], patched, toy.python)
    assert formatted == patched


def test_toy_patched_tree_behaves_like_the_fix_functions(toy):
    fix = toy.main_fix()
    toy.export([fix])
    patched_dir = toy.apply()
    f, ring = toy.fix, toy.upstream.Ring
    expected = {
        "length": f.ring_length(ring(2), 3),
        "describe": f.describe(5),
        "unit_radius": f.unit_ring(ring).radius,
        "area": f.area(2, 3),
        "ring_area": f.ring_area(ring(2)),
        "label": f.RingExtras.label(ring(2)),
    }
    got = run_in_tree(
        patched_dir,
        "import json\n"
        "from sglang.srt.dsv4_export_toy import Ring, area\n"
        "print(json.dumps({'length': Ring(2).length(3), 'describe': Ring.describe(5),\n"
        "    'unit_radius': Ring.unit_ring().radius, 'area': area(2, 3),\n"
        "    'ring_area': Ring(2).ring_area(), 'label': Ring(2).label()}))",
    )
    assert got == expected
    # ... and the pristine toy tree still behaves as before (the child really used the patch)
    pristine = run_in_tree(
        toy.python,
        "import json\nfrom sglang.srt.dsv4_export_toy import area\nprint(json.dumps(area(2, 3)))",
    )
    assert pristine == toy.upstream.area(2, 3) != expected["area"]


HTTP = "sglang.srt.dsv4_export_http"

# An application that records its routes as FastAPI does: the function a route was declared with.
HTTP_SOURCE = """\
ROUTES = {}


class App:
    def get(self, path):
        def declare(func):
            ROUTES[path] = func
            return func

        return declare


app = App()


@app.get("/health")
@app.get("/health_generate")
def health(request):
    return f"upstream answers {request}"


def other():
    return 1
"""

HTTP_FIX_SOURCE = """\
from sglang.srt.dsv4_export_http import health


def checked_health(request):
    if request == "down":
        return "503"
    return health(request)
"""


def test_an_endpoint_taking_upstreams_routes_gets_its_route_decorators(tmp_path, monkeypatch):
    from sglang_dsv4.fix import Routes

    python = write_tree(tmp_path / "upstream", {HTTP: HTTP_SOURCE})
    load(HTTP, python / "sglang/srt/dsv4_export_http.py", monkeypatch)
    (tmp_path / "dsv4_http_fix.py").write_text(HTTP_FIX_SOURCE)
    ours = load("dsv4_http_fix", tmp_path / "dsv4_http_fix.py", monkeypatch).checked_health
    fix = toy_fix(
        "toy-health",
        targets=(f"{HTTP}.health",),
        adds=(Add(HTTP, ours, takes_routes=Routes("health", "(request)")),),
    )
    export.export_series([fix], python, tmp_path / "patches")
    export.apply_series(tmp_path / "patches", python, tmp_path / "applied")
    patched = tmp_path / "applied/python"
    defs = defs_by_qualname(ast.parse((patched / "sglang/srt/dsv4_export_http.py").read_text()))
    # upstream's endpoint keeps its body and loses its routes, which ours takes, right after it
    assert list(defs) == ["App.get", "health", "checked_health", "other"]
    assert defs["health"].decorator_list == []
    decorators = [ast.unparse(d) for d in defs["checked_health"].decorator_list]
    assert decorators == ["app.get('/health')", "app.get('/health_generate')"]
    got = run_in_tree(
        patched,
        "import json\nfrom sglang.srt.dsv4_export_http import ROUTES\n"
        "print(json.dumps({p: [f.__name__, f('ok'), f('down')] for p, f in ROUTES.items()}))",
    )
    answers = ["checked_health", "upstream answers ok", "503"]
    assert got == {"/health": answers, "/health_generate": answers}


def test_kernel_files_are_carried_with_imports_rewritten(toy):
    toy.export([toy.main_fix()])
    patched_dir = toy.apply()
    ops = (patched_dir / "sglang/srt/dsv4_toy_ops.py").read_text()
    assert "from sglang.srt.dsv4_toy_reference import double" in ops
    assert "def triple(x):" in ops
    assert (patched_dir / "sglang/srt/dsv4_toy_reference.py").read_text() == KERNEL_REFERENCE
    patch = next((toy.tmp / "patches").glob("0001-*.patch")).read_text()
    assert "new file mode 100644" in patch


def test_only_what_the_series_writes_changes(toy):
    fix = toy_fix(
        "toy-messy",
        targets=(f"{MESSY}.total",),
        replaces=(Replace(f"{MESSY}.total", toy.fix.total, "(values)"),),
        imports={MESSY: ("from sglang.srt.dsv4_export_toy import SCALE as WEIGHTS_OF_TOTAL",)},
    )
    # the declared import binds the name in the patch, but the fix module lacks it: the runtime
    # hook would raise NameError, so the export refuses
    with pytest.raises(upstream.ExportError, match="WEIGHTS_OF_TOTAL is not bound in dsv4_toy_fix"):
        toy.export([fix])
    toy.fix.WEIGHTS_OF_TOTAL = toy.upstream.SCALE
    (outcome,) = toy.export([fix])
    patch = (toy.tmp / "patches" / outcome.patch).read_text()
    removed = [
        line for line in patch.splitlines() if line.startswith("-") and not line.startswith("---")
    ]
    assert removed == ["-def total( values ):", "-    return sum( values )"]
    patched = (toy.apply() / "sglang/srt/dsv4_export_messy.py").read_text()
    # untouched, unformatted as upstream has it; the declared import on top
    assert "\nWEIGHTS = [1,2,\n    3]\n\ndef total(values):\n" in patched
    # our long line is wrapped to upstream's 88 columns
    assert max(len(line) for line in patched.split("def total")[1].splitlines()) <= 88


def test_source_edited_after_import_is_refused(toy):
    # the hook runs what was imported; a patch from an edited file would be another change
    path = toy.tmp / "dsv4_toy_fix.py"
    path.write_text(path.read_text().replace("turns * 1000", "turns * 100"))
    with pytest.raises(upstream.ExportError, match="no longer holds the ring_length this process"):
        toy.export([toy.main_fix()])


def test_exporting_twice_gives_identical_bytes(toy):
    fixes = [toy.main_fix(), toy_fix("toy-declared")]
    toy.export(fixes, "first")
    toy.export(fixes, "second")
    first, second = patch_files(toy.tmp / "first"), patch_files(toy.tmp / "second")
    assert first == second and len(first) == 3  # kernels, integration, series


def test_stale_patches_are_removed_from_out(toy):
    out = toy.tmp / "patches"
    out.mkdir()
    (out / "0007-old-change.patch").write_text("old")
    (out / "notes.txt").write_text("kept")
    toy.export([toy_fix("toy-declared")])
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "series"]
    assert (out / "series").read_text() == ""


# --- refusals -----------------------------------------------------------------------------------


def test_tree_of_another_version_is_refused(tmp_path, capsys):
    write_tree(tmp_path / "old", {}, version="0.5.22")
    with pytest.raises(upstream.ExportError) as exc:
        upstream.upstream_python_dir(tmp_path / "old")
    assert "sglang 0.5.22" in str(exc.value) and f"pinned to {UPSTREAM_PIN}" in str(exc.value)
    rc = cli.main(
        ["export-patches", "--out", str(tmp_path / "o"), "--upstream-src", str(tmp_path / "old")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "0.5.22" in err and UPSTREAM_PIN in err
    assert not (tmp_path / "o").exists()


def test_tree_without_sglang_or_version_is_refused(tmp_path):
    with pytest.raises(upstream.ExportError, match="holds no upstream sglang source"):
        upstream.upstream_python_dir(tmp_path)
    python = write_tree(tmp_path / "t", {})
    (python / "sglang" / "_version.py").unlink()
    with pytest.raises(upstream.ExportError, match="cannot tell which sglang version"):
        upstream.upstream_python_dir(tmp_path / "t")


@pytest.mark.parametrize(
    "target, message",
    [
        (
            f"{TOY}.Ring.no_such_method",
            f"fix toy-x: target {TOY}.Ring.no_such_method .*not found in python/sglang/srt/dsv4_export_toy.py",
        ),
        (
            f"{TOY}.NoSuchClass.length",
            f"fix toy-x: target {TOY}.NoSuchClass.length .*class NoSuchClass not found",
        ),
        (
            "sglang.srt.no_such_module.f",
            "fix toy-x: target sglang.srt.no_such_module.f .*no_such_module not found",
        ),
    ],
)
def test_missing_target_names_fix_and_target(toy, target, message):
    fix = toy_fix("toy-x", replaces=(Replace(target, toy.fix.ring_length, "(self, turns)"),))
    with pytest.raises(upstream.ExportError, match=message):
        toy.export([fix])


def test_name_that_does_not_resolve_upstream_is_refused(toy):
    fix = toy_fix(
        "toy-x", replaces=(Replace(f"{TOY}.Ring.length", toy.fix.uses_unknown, "(self, turns)"),)
    )
    with pytest.raises(upstream.ExportError) as exc:
        toy.export([fix])
    message = str(exc.value)
    assert "fix toy-x" in message and "function uses_unknown" in message
    assert "name not_bound_anywhere does not resolve in " + TOY in message


def test_name_bound_to_another_object_than_upstream_is_refused(toy):
    # the fix module's Ring2 is not upstream's: make upstream bind the name to something else
    toy.upstream.Ring2 = type("Ring2", (), {})
    source = toy.python / "sglang/srt/dsv4_export_toy.py"
    source.write_text(source.read_text() + "\n\nclass Ring2:\n    pass\n")
    fix = toy_fix("toy-x", adds=(Add(TOY, toy.fix.uses_other_ring),))
    with pytest.raises(
        upstream.ExportError, match="name Ring2 is a different object in dsv4_toy_fix"
    ):
        toy.export([fix])


def test_type_checking_imports_do_not_count_as_bound(toy):
    source = "def uses_ordered():\n    return OrderedDict\n"
    path = toy.tmp / "dsv4_toy_fix_extra.py"
    path.write_text("OrderedDict = object\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("dsv4_toy_fix_extra", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fix = toy_fix("toy-x", adds=(Add(TOY, module.uses_ordered),))
    with pytest.raises(upstream.ExportError, match="name OrderedDict does not resolve"):
        toy.export([fix])


def test_zero_argument_super_is_refused_in_methods(toy):
    fix = toy_fix(
        "toy-x", replaces=(Replace(f"{TOY}.Ring.__init__", toy.fix.calls_super, "(self, radius)"),)
    )
    with pytest.raises(upstream.ExportError, match="fix toy-x: .*zero-argument super"):
        toy.export([fix])


def test_adding_a_name_upstream_already_has_is_refused(toy):
    fix = toy_fix("toy-x", adds=(Add(TOY, toy.fix.area),))
    with pytest.raises(upstream.ExportError, match="already defines area; is the fix upstream"):
        toy.export([fix])


def test_uncarried_distribution_import_is_refused(toy):
    fix = toy_fix(
        "toy-x",
        replaces=(Replace(f"{TOY}.area", toy.fix.area, "(width, height)"),),
        imports={TOY: ("from dsv4_toy_kernels.ops import triple",)},
    )
    with pytest.raises(
        upstream.ExportError, match="imports dsv4_toy_kernels.ops, which upstream's tree lacks"
    ):
        toy.export([fix])


def test_apply_to_a_used_directory_is_refused_before_any_work(tmp_path, capsys):
    used = tmp_path / "tree"
    used.mkdir()
    (used / "notes.txt").write_text("someone's work")
    argv = ["export-patches", "--out", str(tmp_path / "out"), "--apply-to", str(used)]
    rc = cli.main(argv + ["--upstream-src", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "not an empty directory" in err
    assert not (tmp_path / "out").exists() and (used / "notes.txt").read_text() == "someone's work"


def test_missing_download_is_one_clear_error(tmp_path, monkeypatch, capsys):
    # pip with no index and nothing to find: what a machine without the registry sees
    empty = tmp_path / "wheels"
    empty.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    rc = cli.main(["export-patches", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert f"cannot download sglang=={UPSTREAM_PIN}" in err and "--upstream-src" in err
    assert not (tmp_path / "cache" / "sglang-dsv4" / f"sglang-{UPSTREAM_PIN}").exists()


# --- the distribution's own fixes on the pinned release -----------------------------------------


@pytest.fixture(scope="module")
def pinned_upstream() -> Path:
    try:
        return upstream.upstream_python_dir(None)
    except upstream.ExportError as exc:
        pytest.fail(str(exc))  # CI has the registry; without it this proof cannot run


def test_real_series_is_deterministic_applies_and_carries_every_function(pinned_upstream, tmp_path):
    from sglang_dsv4.fixes import FIXES

    first = export.export_series(FIXES, pinned_upstream, tmp_path / "first")
    export.export_series(FIXES, pinned_upstream, tmp_path / "second")
    assert patch_files(tmp_path / "first") == patch_files(tmp_path / "second")

    exported = [o.fix for o in first if o.patch]
    for o in first:
        expect_patch = o.fix.implemented and not o.fix.upstream.startswith("upstream since")
        assert (o.patch is not None) == expect_patch, (o.fix.id, o.note)
        assert len(o.patches) == (1 + bool(o.fix.new_files) if expect_patch else 0)

    names = export.apply_series(tmp_path / "first", pinned_upstream, tmp_path / "tree")
    assert names == [name for o in first for name in o.patches]
    subjects = upstream.git(["log", "--reverse", "--format=%s"], tmp_path / "tree").splitlines()
    expected = [f"upstream sglang {UPSTREAM_PIN}"]
    for f in exported:
        if f.new_files:
            expected.append(f"{f.area}: kernels for {f.title} (new files)")
        expected.append(f"{f.area}: {f.title}")
    assert subjects == expected

    # every function the plugin installs stands in the patched tree, as its own source
    python = tmp_path / "tree" / "python"
    for fix in exported:
        for path, func in [(r.target, r.func) for r in fix.replaces] + [
            (a.target, a.func) for a in fix.adds
        ]:
            routed = any(a.func is func and a.takes_routes for a in fix.adds)
            parts = path.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                file = python / ("/".join(parts[:cut]) + ".py")
                if file.is_file():
                    break
            defs = defs_by_qualname(ast.parse(file.read_text()))
            qualname = ".".join(parts[cut:])
            assert qualname in defs, f"{fix.id}: {path} missing from {file}"
            written = defs[qualname]
            if routed:  # it wears the route decorators it took from upstream's endpoint
                assert written.decorator_list, f"{fix.id}: {path} took no routes"
                written.decorator_list = []
            assert comparable(written) == comparable(source_def(func)), f"{fix.id}: {path}"
