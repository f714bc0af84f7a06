"""The plugin in real processes: discovery by upstream's loader, loud refusals, status.

Each case runs in a fresh interpreter, because upstream's loader and HookRegistry are process-wide
and run once: forked by `sglang_dsv4.warm_python` from a process that has imported the third-party
libraries upstream needs (torch, transformers, ...) and nothing of SGLang or of the distribution,
so each case imports SGLang and the plugin anew without paying some 12 CPU-seconds for torch. Where a case needs a condition this machine cannot have (another installed sglang
version), the subprocess replaces only the version lookup and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fastapi import Request
from sglang_dsv4 import UPSTREAM_PIN, warm_python
from sglang_dsv4.fixes import FIXES

REFUSAL = "sglang-dsv4: refusing to run: "


# A hang guard for a fresh interpreter importing sglang (and, for some cases, a spawned child
# doing it again): about 30 s on a quiet machine, past 300 s on a loaded one. Not a speed bound.
HANG_GUARD_S = 900


def run_py(
    code: str, env: dict | None = None, timeout: int = HANG_GUARD_S
) -> subprocess.CompletedProcess:
    return python("-c", textwrap.dedent(code), env=env, timeout=timeout)


def python(*argv: str, env: dict | None = None, timeout: int = HANG_GUARD_S):
    """`python ARGV` in a fresh interpreter (warm-forked), its output captured as text."""
    return warm_python.run(list(argv), env={**os.environ, **(env or {})}, timeout=timeout)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


HEAVY = (
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
    "sglang.srt.layers.attention.dsv4.indexer",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.model_executor.pool_configurator",
    "sglang_dsv4.fixes.index_k_bf16",
)


def test_upstream_loader_discovers_plugin_and_patches_every_target():
    proc = run_py(
        f"""
        import json, sys
        from importlib.metadata import entry_points
        eps = [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dsv4_sm120"]
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang_dsv4 import hooks, plugin
        # Start-up imports no fix module and none of the upstream modules they hook.
        heavy_after_load = [m for m in {HEAVY!r} if m in sys.modules]
        after_load = {{k: v.status for k, v in plugin.STATE.items()}}
        # Upstream importing a module applies the fixes (or their parts) it holds, at once.
        import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool
        after_pool = {{k: v.status for k, v in plugin.STATE.items()}}
        bf16_storage = pool.dsv4_index_k_bytes_per_token(128, "bf16")
        plugin.settle()
        from sglang_dsv4.fixes import FIXES
        def stale_bindings():
            # Scan inside a function: a module-level loop variable would itself be a binding.
            found = []
            for fix in FIXES:
                for rep in fix.replaces:
                    _, _, current = hooks.resolve(rep.target)
                    original = getattr(current, "__wrapped__", None)
                    # No module may keep a `from X import Y` binding of the original.
                    for name, mod in list(sys.modules.items()):
                        for attr, value in list(getattr(mod, "__dict__", {{}}).items()):
                            if original is not None and value is original:
                                found.append(f"{{name}}.{{attr}}")
            return found
        stale = stale_bindings()
        print(json.dumps({{
            "eps": eps,
            "heavy_after_load": heavy_after_load,
            "after_load": after_load,
            "after_pool": after_pool,
            "bf16_storage": bf16_storage,
            "state": {{k: v.status for k, v in plugin.STATE.items()}},
            "verify": {{f.id: hooks.verify(f) for f in FIXES if f.implemented}},
            "stale": stale,
        }}))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(last_line(proc.stdout))
    assert out["eps"] == ["sglang_dsv4.plugin:load"]
    assert out["heavy_after_load"] == []
    assert set(out["after_load"].values()) == {"pending"}
    # The transfer gate lives in the pool module alone; index-k-bf16 also waits for the backend.
    assert out["after_pool"]["index-k-transfer-gate"] == "applied"
    assert out["after_pool"]["index-k-bf16"] == "pending"
    assert out["after_pool"]["nixl-bootstrap-cascade"] == "pending"
    assert out["bf16_storage"] == 256
    assert set(out["state"]) == {f.id for f in FIXES}
    for fix in FIXES:
        expected = "applied" if fix.implemented else "declared, not implemented"
        assert out["state"][fix.id] == expected, (fix.id, out["state"][fix.id])
    assert all(reason is None for reason in out["verify"].values()), out["verify"]
    assert out["stale"] == []


def test_register_names_every_fix_module_and_the_upstream_modules_of_its_targets():
    # The plugin reads REGISTER without importing fix modules; it must say what FIX says.
    from sglang_dsv4.fixes import REGISTER

    assert [entry.id for entry in REGISTER] == [fix.id for fix in FIXES]
    for entry, fix in zip(REGISTER, FIXES, strict=True):
        assert entry.load() is fix
        assert entry.implemented == fix.implemented
        holding = {
            max((m for m in entry.upstream_modules if t.startswith(m + ".")), key=len, default=None)
            for t in fix.hooked_targets
        }
        assert None not in holding, (fix.id, "a target in no listed module")
        assert holding == set(entry.upstream_modules), (fix.id, "a listed module holds no target")


def test_each_fix_modules_docstring_opens_with_its_register_text():
    # One source: the Fix. The docstring is rendered from it (python -m sglang_dsv4.fix).
    import importlib

    from sglang_dsv4.fix import docstring_problem, register_text
    from sglang_dsv4.fixes import REGISTER

    for entry in REGISTER:
        module = importlib.import_module(entry.module)
        assert docstring_problem(module.FIX, module.__doc__) is None, entry.module
        text = register_text(module.FIX)
        for field in ("Target:", "Why:", "How:", "Upstream:", "Remove when:"):
            assert f"\n  {field}" in text


def test_a_docstring_that_drifted_from_its_fix_is_named():
    from sglang_dsv4.fix import docstring_problem, register_text

    fix = FIXES[0]
    drifted = register_text(fix).replace(fix.remove_when.split()[0], "someday", 1)
    assert docstring_problem(fix, drifted) is not None
    assert docstring_problem(fix, register_text(fix) + "\nMore notes.\n") is None


BROKEN_TARGET_LAUNCH = """
    import runpy, sys
    {prepare}
    sys.argv = ["sglang.launch_server", "--model-path", "/nonexistent-model"]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    print("SERVER START WAS NOT STOPPED")
"""

TEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)))


def test_fix_written_for_another_signature_stops_launch_server():
    # The target's module is imported before plugins load (as in a scheduler process that
    # unpickled its arguments): the plugin checks the fix inside load_plugins().
    prepare = f"""
    sys.path.insert(0, {TEST_DIR!r})
    from support import broken_fix
    broken_fix.register()
    import sglang.srt.mem_cache.deepseek_v4_memory_pool
    """
    proc = run_py(
        BROKEN_TARGET_LAUNCH.format(prepare=textwrap.indent(textwrap.dedent(prepare), "    "))
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SERVER START WAS NOT STOPPED" not in proc.stdout
    line = last_line(proc.stderr)
    assert line.startswith(REFUSAL + "fix broken-fix: target "), line
    assert "get_swa_ring_size: signature is (sliding_window, is_speculative=False)" in line
    assert "written for (sliding_window)" in line


def test_fix_checked_when_a_scheduler_imports_its_target_stops_that_scheduler_loudly():
    # A scheduler process loads plugins first and imports the model's modules later: the broken
    # fix refuses at that import. Upstream's launcher waits on the scheduler's pipe with its own
    # `_wait_for_scheduler_ready`, and reports the dead scheduler; the refusal line is the
    # scheduler's last word on stderr. (The scheduler is a stand-in: no GPU here to start one.)
    proc = run_py(
        f"""
        import multiprocessing, sys
        sys.path.insert(0, {TEST_DIR!r})
        from support import broken_fix
        from sglang.srt.entrypoints.engine import _wait_for_scheduler_ready
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=broken_fix.scheduler, args=(writer,))
        child.start()
        writer.close()
        try:
            _wait_for_scheduler_ready([reader], [child])
            print("SCHEDULER READY")
        except RuntimeError as exc:
            print("LAUNCHER:", exc)
        """
    )
    assert "SCHEDULER READY" not in proc.stdout, proc.stdout
    assert "LAUNCHER: Rank 0 scheduler died during initialization (exit code: 1)" in proc.stdout
    refusals = [ln for ln in proc.stderr.splitlines() if ln.startswith(REFUSAL)]
    assert len(refusals) == 1, proc.stderr[-3000:]
    assert refusals[0].startswith(REFUSAL + "fix broken-fix: target "), refusals[0]
    assert "written for (sliding_window)" in refusals[0]


def test_fix_failing_on_an_import_in_another_thread_stops_the_whole_process():
    # SystemExit would end only that thread, quietly: the process must stop, with the line.
    proc = run_py(
        f"""
        import sys, threading
        sys.path.insert(0, {TEST_DIR!r})
        from support import broken_fix
        broken_fix.register()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        def load_model():
            import sglang.srt.mem_cache.deepseek_v4_memory_pool
        worker = threading.Thread(target=load_model)
        worker.start()
        worker.join()
        print("PROCESS WENT ON")
        """
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "PROCESS WENT ON" not in proc.stdout
    assert last_line(proc.stderr).startswith(REFUSAL + "fix broken-fix: target ")


@pytest.mark.parametrize("fix", [f for f in FIXES if f.replaces], ids=lambda f: f.id)
def test_real_fix_with_moved_target_stops_launch_server(fix):
    # Upstream "moves": the first target of a real fix gets a different signature before plugins load.
    target = fix.replaces[0].target
    prepare = f"""
    from sglang_dsv4 import hooks
    owner, name, _ = hooks.resolve({target!r})
    def moved(self_or_arg, *, renamed_parameter=None):
        return None
    setattr(owner, name, moved)
    """
    proc = run_py(
        BROKEN_TARGET_LAUNCH.format(prepare=textwrap.indent(textwrap.dedent(prepare), "    "))
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = last_line(proc.stderr)
    assert line.startswith(f"{REFUSAL}fix {fix.id}: target {target}: signature is"), line


VERSION_CHECK = """
    # This machine has only the pinned sglang installed; another installed version is simulated
    # by replacing the plugin's version lookup, nothing else.
    import sglang_dsv4.plugin as plugin
    plugin.upstream_version = lambda: "0.5.99"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    print("PLUGINS LOADED", sorted(s.status for s in plugin.STATE.values()))
"""


def test_other_upstream_version_is_refused_with_one_line():
    proc = run_py(VERSION_CHECK)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "PLUGINS LOADED" not in proc.stdout
    assert last_line(proc.stderr) == (
        f"{REFUSAL}upstream sglang is 0.5.99, the distribution is pinned to {UPSTREAM_PIN} "
        "(set SGLANG_DSV4_ALLOW_UNPINNED=1 to run anyway)"
    )


def test_allow_unpinned_lets_other_version_through_with_warning():
    proc = run_py(VERSION_CHECK, env={"SGLANG_DSV4_ALLOW_UNPINNED": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PLUGINS LOADED" in proc.stdout
    assert f"upstream sglang is 0.5.99, the distribution is pinned to {UPSTREAM_PIN}" in proc.stderr
    assert "running anyway" in proc.stderr


def test_bad_index_k_dtype_stops_launch_server_listing_allowed_values():
    proc = python("-m", "sglang.launch_server", "--help", env={"SGLANG_DSV4_INDEX_K_DTYPE": "int8"})
    assert proc.returncode == 1
    assert "usage:" not in proc.stdout
    assert last_line(proc.stderr) == (
        f"{REFUSAL}SGLANG_DSV4_INDEX_K_DTYPE='int8' is not supported; allowed: fp8, bf16, fp4"
    )


def test_launch_server_help_still_works_with_the_distribution_installed():
    proc = python("-m", "sglang.launch_server", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--model-path" in proc.stdout


def test_status_json_lists_the_five_changes():
    proc = python("-m", "sglang_dsv4", "status", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Upstream's import-time noise stays out of the command line (a server keeps it).
    for noise in ("support AWQ", "support GGUF", "Cannot detect CUDA architecture"):
        assert noise not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    ids = [f["id"] for f in report["fixes"]]
    assert ids == [
        "index-k-bf16",
        "pool-sizing-bf16",
        "index-k-transfer-gate",
        "host-mirror-geometry",
        "nixl-bootstrap-cascade",
        "nixl-control-health",
    ]
    for item in report["fixes"]:
        assert isinstance(item["applied"], bool)
        assert item["applied"] == (item["status"] == "applied")
        assert item["status"] in {"applied", "declared, not implemented"}
    assert report["upstream"] == {"version": UPSTREAM_PIN, "pin": UPSTREAM_PIN}
    assert report["plugin_loaded"] is True
    assert report["index_k_dtype"] in {"fp8", "bf16", "fp4"}
    assert report["cuda_device"]["name"]  # "none" without a GPU


def test_status_strict_fails_when_the_plugin_is_excluded():
    proc = python("-m", "sglang_dsv4", "status", "--json", "--strict",
                  env={"SGLANG_PLUGINS": "some_other_plugin"})
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["plugin_loaded"] is False
    assert {f["status"] for f in report["fixes"]} == {"not loaded"}


# --- an added endpoint taking an upstream endpoint's routes (fix.Routes) -------------------


def toy_http_module(monkeypatch):
    """A module with a real FastAPI application whose /health routes serve `health`."""
    import types

    from fastapi import FastAPI

    module = types.ModuleType("dsv4_toy_http")
    module.app = app = FastAPI()

    @app.get("/health", tags=["probes"])
    @app.get("/health_generate")
    async def health(request: Request):
        return {"answered_by": "upstream", "path": request.url.path}

    @app.get("/other")
    async def other():
        return {}

    module.health, module.other = health, other
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


async def checked_health(request: Request):  # FastAPI reads the annotation
    if request.query_params.get("down"):
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse("NIXL thread down", status_code=503)
    return await sys.modules["dsv4_toy_http"].health(request)


def routes_fix(routes):
    from sglang_dsv4.fix import Add, Fix

    add = Add("dsv4_toy_http", checked_health, takes_routes=routes)
    return Fix("toy", "t", "test", "w", "h", "not upstream", "never", (), adds=(add,))


def test_an_added_endpoint_serves_the_routes_it_takes_and_calls_upstreams(monkeypatch):
    from sglang_dsv4 import hooks
    from sglang_dsv4.fix import Routes
    from starlette.testclient import TestClient

    module = toy_http_module(monkeypatch)
    order = [r.path for r in module.app.routes]
    before = {r.path: r for r in module.app.routes if r.path.startswith("/health")}
    fix = routes_fix(Routes("health", "(request)"))
    assert hooks.precheck(fix) is None
    assert hooks.install([], list(fix.adds)) is None
    assert hooks.verify(fix) is None

    client = TestClient(module.app)
    assert client.get("/health").json() == {"answered_by": "upstream", "path": "/health"}
    down = client.get("/health_generate", params={"down": 1})
    assert (down.status_code, down.text) == (503, "NIXL thread down")
    after = {r.path: r for r in module.app.routes if r.path.startswith("/health")}
    for path, route in after.items():  # the same route, another endpoint
        assert route.endpoint is checked_health and before[path].endpoint is module.health
        assert (route.name, route.methods, route.tags, type(route)) == (
            before[path].name,
            before[path].methods,
            before[path].tags,
            type(before[path]),
        )
    assert [r.path for r in module.app.routes] == order  # each in its place: matched as before


@pytest.mark.parametrize(
    "routes, reason",
    [
        (("health", "(request, timeout)"), "signature is (request), the fix was written for"),
        (("healthz", "(request)"), "target dsv4_toy_http.healthz: not found upstream"),
        (("health", "(request)", "application"), "dsv4_toy_http.application is not a FastAPI"),
        (("checked", "(request)"), "target dsv4_toy_http.checked: no route of app serves it"),
    ],
)
def test_taking_routes_is_refused_when_upstream_moved(monkeypatch, routes, reason):
    from sglang_dsv4 import hooks
    from sglang_dsv4.fix import Routes

    module = toy_http_module(monkeypatch)

    async def checked(request):  # an endpoint no route serves
        return None

    module.checked = checked
    found = hooks.precheck(routes_fix(Routes(*routes)))
    assert found is not None and reason in str(found), found
    assert all(r.endpoint is not checked_health for r in module.app.routes)
