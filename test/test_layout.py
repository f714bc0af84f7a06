"""The package layout: every package is installed, and sglang_dsv4's imports form no circle.

CI installs with a fresh `pip install -e .`, which ships only the packages pyproject.toml lists;
a subpackage left out imports from a checkout and fails installed. Imports are read from the
source (module level and inside functions alike), so a circle hidden in a function counts too.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"sglang_dsv4": REPO / "python", "sgl_kernel_dsv4": REPO / "sgl-kernel" / "python"}


def declared_packages() -> set[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def modules() -> dict[str, Path]:
    found = {}
    for top, root in ROOTS.items():
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def test_every_package_of_the_tree_is_installed():
    packages = {
        ".".join(p.parent.relative_to(root).parts)
        for top, root in ROOTS.items()
        for p in (root / top).rglob("__init__.py")
    }
    assert packages == declared_packages()


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The distribution modules `name` imports (a package's own __init__ excluded)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    # a submodule's import runs its package's __init__ first: not an edge of its own
    return {t for t in out if not name.startswith(t + ".")}


def test_the_distributions_imports_form_no_circle():
    # sglang_dsv4 only: the kernel package's module pairs are being untangled on their own.
    found = {n: p for n, p in modules().items() if n.split(".")[0] == "sglang_dsv4"}
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    circles = []

    def visit(node, stack, done):
        if node in stack:
            circles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, stack + [node], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert circles == [], [" -> ".join(c) for c in circles]


def test_the_readme_layout_names_every_module_of_the_distribution():
    text = (REPO / "README.md").read_text()
    section = text.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[\w/]+(?:\.py|/)", section))
    package = REPO / "python" / "sglang_dsv4"
    present = {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    present |= {f"{p.name}/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert present <= named, sorted(present - named)
    # and it names nothing that is not there
    listed = {n for n in named if n.endswith(".py") and "/" not in n}
    assert listed <= present | {"__init__.py"}, sorted(listed - present)
    for sub in ("plan", "maintain", "sanitizer"):
        words = set(re.findall(r"\w+", section.split(f"{sub}/", 1)[1].split("\n", 1)[0]))
        modules = {p.stem for p in (package / sub).glob("*.py") if p.stem != "__init__"}
        assert modules <= words, (sub, sorted(modules - words))
    # a fix written as a package: the fixes/ entry names it and each of its modules
    fixes_entry = section.split("fixes/", 1)[1].split("\n  sanitizer/", 1)[0]
    words = set(re.findall(r"\w+", fixes_entry))
    for fix_package in (p for p in (package / "fixes").iterdir() if (p / "__init__.py").exists()):
        assert f"{fix_package.name}/" in fixes_entry, fix_package.name
        modules = {p.stem for p in fix_package.glob("*.py") if p.stem != "__init__"}
        assert modules <= words, (fix_package.name, sorted(modules - words))


MAX_MODULE_LINES = 900


def test_no_module_of_the_distribution_is_over_900_lines():
    paths = [*modules().values(), *(REPO / "benchmark").rglob("*.py")]
    long = {
        str(path.relative_to(REPO)): n
        for path in paths
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
