"""End-to-end tests over real CPU servers of the tiny DeepSeek-V4 (`sglang-dsv4 tiny-model`).

Every test here is marked `e2e` (select them with `-m e2e`, leave them out with `-m "not e2e"`);
`python -m pytest -q` runs them with the rest. Servers are session or module fixtures, started
once, shared by the tests that need them and stopped (process group, SIGTERM then SIGKILL) at the
end of their scope; each server's log is kept under the session's temporary directory and its
tail is printed when a start fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.live import POOL_ARGS, SERVER_ARGS, Fleet, Proc, env_for


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    import importlib.util

    from sglang_dsv4.tiny_model import write

    # Upstream alone cannot run a DeepSeek-V4 forward on the CPU (eight CUDA-only JIT ops); the
    # distribution's CPU backend (issue #22, part 1) supplies them. Without it in this tree there
    # is nothing to serve: the servers' tests are skipped, saying why.
    if importlib.util.find_spec("sglang_dsv4.cpu_backend") is None:
        pytest.skip("no sglang_dsv4.cpu_backend in this tree: no DeepSeek-V4 forward on the CPU")

    return write(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    with Fleet(tmp_path_factory.mktemp("servers")) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def plain_launched(fleet, tiny_model_dir) -> Proc:
    """One plain CPU server, fp8 index keys (upstream's numerics), no HiCache, no PD: launched."""
    return fleet.server(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, name="plain-fp8",
                        env=env_for("fp8"), wait=False)


@pytest.fixture(scope="session")
def plain(plain_launched) -> Proc:
    """The plain server, up."""
    return plain_launched.ready()


@pytest.fixture(scope="session")
def plain_twin_launched(fleet, tiny_model_dir) -> Proc:
    """The plain server's twin (same checkpoint, arguments and seed): test_sessions runs each
    session alone on it while all of them run together on the plain server."""
    return fleet.server(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, name="plain-fp8-twin",
                        env=env_for("fp8"), wait=False)


@pytest.fixture(scope="session")
def plain_twin(plain_twin_launched) -> Proc:
    return plain_twin_launched.ready()


# Servers start side by side: a start is mostly one process importing and building on one core,
# and this machine has two. A server fixture X that depends on X_launched (launch, no wait) is
# launched before the first test that needs it: a module's at the module's start, all at once;
# the plain server, which nearly every module uses, at the session's start; the session's other
# servers one module ahead of their first user, once that module's own servers answer (so the
# start overlaps that module's tests, which mostly keep one core busy or wait).
AT_SESSION_START = ("plain_launched",)
SESSION_FIXTURES = ("plain_launched", "plain_twin_launched")  # a module's own: in its file


def _launched_names(items) -> list[str]:
    return sorted({n for item in items for n in item.fixturenames if n.endswith("_launched")})


def _e2e_modules(items) -> list[list]:
    """The selected e2e tests, grouped by module, in run order."""
    here = Path(__file__).parent
    modules: dict = {}
    for item in items:
        if here in Path(str(item.fspath)).parents:
            modules.setdefault(item.module, []).append(item)
    return list(modules.values())


@pytest.fixture(scope="session", autouse=True)
def _launch_session_servers(request):
    for name in _launched_names(request.session.items):
        if name in AT_SESSION_START:
            request.getfixturevalue(name)


@pytest.fixture(scope="module", autouse=True)
def _launch_module_servers(request, fleet, _launch_session_servers):
    modules = _e2e_modules(request.session.items)
    index = next(i for i, tests in enumerate(modules) if tests[0].module is request.module)
    own = [request.getfixturevalue(name) for name in _launched_names(modules[index])]
    if index + 1 < len(modules):
        ahead = [name for name in _launched_names(modules[index + 1])
                 if name not in _launched_names(modules[index]) and name in SESSION_FIXTURES]
        if ahead:
            for server in own:
                server.ready()
            for name in ahead:
                request.getfixturevalue(name)
    yield
    if index + 1 == len(modules):
        # After the last e2e module the session's servers would only hold memory (some 2.4 GB
        # each) while the rest of the run goes on.
        used = [n for n in _launched_names(request.session.items) if n in SESSION_FIXTURES]
        fleet.retire(*(request.getfixturevalue(name) for name in used))


@pytest.fixture(scope="session")
def sanitized_servers() -> list:
    """Every server the suite started, for the closing sanitizer check (test_zz_sanitizer.py)."""
    return []


@pytest.fixture(autouse=True)
def _note_servers(request, sanitized_servers):
    yield
    for name in ("plain", "plain_twin", "pd", "hicache", "hicache_off"):
        if name in request.fixturenames:
            server = request.getfixturevalue(name)
            targets = [server.prefill, server.decode] if hasattr(server, "decode") else [server]
            for target in targets:
                if target not in sanitized_servers:
                    sanitized_servers.append(target)
