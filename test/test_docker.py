"""The container image and the PD deployment: docker/ and scripts/, checked without Docker.

There is no Docker engine or GPU here; the image is built and run on GPU hosts. These tests check
what decides whether it would serve: hadolint and ShellCheck on the files; every command the
entrypoint prints is parsed by upstream's own parsers (sglang's ServerArgs, sglang_router's
RouterArgs) with abbreviations off, so a flag that sglang 0.5.23 does not know fails; the compose
file's services fed through the entrypoint the same way; one source for every version.
"""

from __future__ import annotations

import argparse
import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from importlib.metadata import requires, version
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.pd.yaml"
LAUNCHERS = {
    role: REPO / "scripts" / f"launch_{role}.sh" for role in ("prefill", "decode", "router")
}
SERVER_PREFIX = ["python3", "-m", "sglang.launch_server"]
ROUTER_PREFIX = ["python3", "-m", "sglang_router.launch_router"]
DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"


class FlagError(Exception):
    """Upstream's parser rejected the command line."""


class StrictParser(argparse.ArgumentParser):
    """Upstream's arguments, but an error raises instead of exiting, and no abbreviations."""

    def __init__(self):
        super().__init__(allow_abbrev=False)

    def error(self, message):
        raise FlagError(message)


@pytest.fixture(scope="module")
def parse_server():
    from sglang.srt.server_args import ServerArgs

    parser = StrictParser()
    ServerArgs.add_cli_args(parser)

    def parse(argv: list[str]):
        return ServerArgs.from_cli_args(parser.parse_args(argv))

    return parse


@pytest.fixture(scope="module")
def parse_router():
    from sglang_router.router_args import RouterArgs

    parser = StrictParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)

    def parse(argv: list[str]):
        return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)

    return parse


def tool(name: str) -> str:
    """A linter from the [test] extra: beside this interpreter, or on PATH."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert path, f"{name} not found: install the project's [test] extra"
    return path


def run(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Only the variables a test names: the caller's MODEL_PATH or PORT must not leak in. The
    # entrypoint checks settings with `python3 -m sglang_dsv4.envcheck`: this interpreter's
    # python3 first on PATH (and the tree under test), as in the image.
    base = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if os.environ.get("PYTHONPATH"):
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        ["bash", str(script), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,  # a HICACHE_* choice check imports upstream's ServerArgs
    )


def dry_run(*args: str, env: dict[str, str] | None = None, script: Path = ENTRYPOINT) -> list[str]:
    result = run(script, *args, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0])


def server_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(index-K dtype, launch_server arguments) of a printed prefill/decode command."""
    assert argv[0] == "env" and argv[1].startswith(f"{DTYPE_ENV}="), argv
    assert argv[2:5] == SERVER_PREFIX, argv
    return argv[1].split("=", 1)[1], argv[5:]


def router_argv(argv: list[str]) -> list[str]:
    assert argv[:3] == ROUTER_PREFIX, argv
    return argv[3:]


# --- linters -------------------------------------------------------------------------------


def test_hadolint_finds_nothing_in_the_dockerfile():
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_finds_nothing_in_the_entrypoint_and_launchers():
    scripts = [ENTRYPOINT, *LAUNCHERS.values()]
    result = subprocess.run(
        [tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


IMAGE_SCRIPTS = [REPO / "scripts" / "build-image.sh", REPO / "scripts" / "image-smoke.sh"]


def test_shellcheck_finds_nothing_in_the_image_scripts():
    result = subprocess.run(
        [tool("shellcheck"), *map(str, IMAGE_SCRIPTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def build_image(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    env.pop("IMAGE_BUILDER", None)
    return subprocess.run([shutil.which("bash"), str(IMAGE_SCRIPTS[0]), *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("args, words", [
    (["--tga", "x"], "unknown argument '--tga'"),
    (["--build-arg", "NOVALUE"], "--build-arg takes KEY=VALUE, got 'NOVALUE'"),
    (["--ca-bundle", "/nonexistent/ca.pem"], "--ca-bundle: cannot read '/nonexistent/ca.pem'"),
    (["--builder", "kaniko"], "unknown builder 'kaniko'"),
    (["--tag"], "--tag needs a value"),
])
def test_build_image_refuses_bad_arguments_with_one_line_before_building(args, words):
    result = build_image(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"build-image: {words}"), result.stderr
    assert not result.stdout


def test_build_image_without_any_builder_says_what_to_install(tmp_path):
    # A PATH with what the script itself needs and no docker, podman or buildah.
    for name in ("sed", "head", "dirname"):
        (tmp_path / name).symlink_to(shutil.which(name))
    result = build_image(path=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == ("build-image: no image builder here: install docker (with its "
                             "engine), podman or buildah\n")


def test_a_docker_client_without_an_engine_is_not_a_builder():
    if not shutil.which("docker"):
        pytest.skip("no docker client here")
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        pytest.skip("docker has an engine here")
    result = build_image("--builder", "docker")
    assert result.returncode == 2
    assert "docker cannot build here (not installed, or docker without a running engine)" in (
        result.stderr)


# --- serving roles through upstream's parsers ---------------------------------------------


def test_prefill_command_parses_with_upstream_server_args(parse_server):
    env = {
        "MODEL_PATH": "/models/DeepSeek-V4-Flash",
        "TP": "8",
        "HOST": "10.1.2.3",
        "PORT": "31000",
        "DISAGG_BOOTSTRAP_PORT": "9100",
        "IB_DEVICE": "mlx5_0,mlx5_1",
        "MEM_FRACTION": "0.82",
        "NCCL_PORT": "32000",
        "SERVED_MODEL_NAME": "dsv4-flash",
        "ENABLE_HICACHE": "1",
        "HICACHE_RATIO": "2.5",
        "HICACHE_WRITE_POLICY": "write_back",
        "HICACHE_IO_BACKEND": "direct",
        "HICACHE_MEM_LAYOUT": "page_first_direct",
        DTYPE_ENV: "fp8",
    }
    dtype, argv = server_argv(dry_run("prefill", "--dry-run", env=env))
    args = parse_server(argv)
    assert dtype == "fp8"
    assert args.model_path == "/models/DeepSeek-V4-Flash"
    assert (args.tp_size, args.host, args.port) == (8, "10.1.2.3", 31000)
    assert args.disaggregation_mode == "prefill"
    assert args.disaggregation_transfer_backend == "nixl"
    assert args.disaggregation_bootstrap_port == 9100
    assert args.disaggregation_ib_device == "mlx5_0,mlx5_1"
    assert args.mem_fraction_static == pytest.approx(0.82)
    assert (args.nccl_port, args.served_model_name) == (32000, "dsv4-flash")
    assert args.enable_hierarchical_cache is True
    assert args.hicache_ratio == pytest.approx(2.5)
    assert (args.hicache_write_policy, args.hicache_io_backend) == ("write_back", "direct")
    assert args.hicache_mem_layout == "page_first_direct"


def test_decode_command_defaults(parse_server):
    dtype, argv = server_argv(dry_run("--dry-run", "decode", env={"MODEL_PATH": "/m"}))
    args = parse_server(argv)
    assert dtype == "bf16"  # the image's default for DeepSeek-V4
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == ("decode", "nixl")
    assert (args.tp_size, args.host, args.port) == (4, "0.0.0.0", 30001)
    # Optional settings left unset stay upstream's defaults: no flag is printed for them.
    for flag in (
        "--disaggregation-ib-device",
        "--mem-fraction-static",
        "--nccl-port",
        "--enable-hierarchical-cache",
        "--disaggregation-bootstrap-port",
    ):
        assert flag not in argv


def test_extra_args_and_arguments_after_the_role_pass_through(parse_server):
    env = {"MODEL_PATH": "/m", "EXTRA_ARGS": "--page-size 256  --log-level debug", "PORT": "30005"}
    argv = dry_run(
        "decode", "--dry-run", "--served-model-name", "deep seek v4", "--port", "30009", env=env
    )
    args = parse_server(server_argv(argv)[1])
    assert (args.page_size, args.log_level) == (256, "debug")
    assert args.served_model_name == "deep seek v4"  # quoting survives the printed command
    assert args.port == 30009  # the later flag wins, as upstream's parser has it


@pytest.mark.parametrize("extra", ["--no-such-flag 1", "--tp 2", "--disaggregation-mode both"])
def test_a_flag_upstream_does_not_know_fails_the_parse(parse_server, extra):
    # An unknown flag, an abbreviation of a real one, a value outside the choices.
    argv = dry_run("prefill", "--dry-run", env={"MODEL_PATH": "/m", "EXTRA_ARGS": extra})
    with pytest.raises(FlagError):
        parse_server(server_argv(argv)[1])


def test_router_command_parses_with_the_router_parser(parse_router):
    env = {
        "PREFILL_URLS": "http://10.0.0.1:30000@9001, http://10.0.0.2:30000",
        "DECODE_URLS": "http://10.0.0.3:30001,http://10.0.0.4:30001,",
        "DISAGG_BOOTSTRAP_PORT": "9000",
        "PORT": "8080",
        "EXTRA_ARGS": "--policy round_robin",
    }
    args = parse_router(router_argv(dry_run("router", "--dry-run", env=env)))
    assert args.pd_disaggregation is True
    assert args.prefill_urls == [("http://10.0.0.1:30000", 9001), ("http://10.0.0.2:30000", 9000)]
    assert args.decode_urls == ["http://10.0.0.3:30001", "http://10.0.0.4:30001"]
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 8080, "round_robin")


def test_router_rejects_what_its_parser_does_not_know(parse_router):
    env = {
        "PREFILL_URLS": "http://p:30000",
        "DECODE_URLS": "http://d:30001",
        "EXTRA_ARGS": "--no-such-router-flag",
    }
    with pytest.raises(FlagError):
        parse_router(router_argv(dry_run("router", "--dry-run", env=env)))


def test_status_and_plan_commands_parse_with_the_distribution_cli():
    from sglang_dsv4.cli import COMMANDS, build_parser

    argv = dry_run("--dry-run", "status", "--strict", "--json", env={})
    assert argv[:5] == ["env", f"{DTYPE_ENV}=bf16", "python3", "-m", "sglang_dsv4"]
    args = build_parser().parse_args(argv[5:])
    assert (args.command, args.strict, args.json) == ("status", True, True)

    argv = dry_run("--dry-run", "plan", "--json", env={"MODEL_PATH": "/models/v4", "TP": "8"})
    assert argv[5:] == ["plan", "--model", "/models/v4", "--tp", "8", "--json"]
    if "plan" not in COMMANDS:
        pytest.skip("`sglang-dsv4 plan` is not in this tree yet; its printed command is checked")
    assert build_parser().parse_args(argv[5:]).command == "plan"


# --- loud failures -------------------------------------------------------------------------


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str, rc: int = 2):
    assert result.returncode == rc, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    ("role", "env", "missing"),
    [
        ("prefill", {}, "MODEL_PATH"),
        ("decode", {"TP": "4"}, "MODEL_PATH"),
        ("router", {"DECODE_URLS": "http://d:30001"}, "PREFILL_URLS"),
        ("router", {"PREFILL_URLS": "http://p:30000"}, "DECODE_URLS"),
        ("prefill", {"MODEL_PATH": ""}, "MODEL_PATH"),
    ],
)
def test_a_missing_variable_stops_with_a_line_naming_it(role, env, missing):
    result = run(ENTRYPOINT, role, "--dry-run", env=env)
    assert_one_line_error(result, missing, "is not set")


@pytest.mark.parametrize(
    ("role", "env", "words"),
    [
        ("prefill", {"MODEL_PATH": "/m", "TP": "four"}, ["TP", "'four'"]),
        ("prefill", {"MODEL_PATH": "/m", "PORT": "70000"}, ["PORT", "70000"]),
        ("decode", {"MODEL_PATH": "/m", "MEM_FRACTION": "1.5"}, ["MEM_FRACTION"]),
        ("decode", {"MODEL_PATH": "/m", "ENABLE_HICACHE": "maybe"}, ["ENABLE_HICACHE"]),
        (
            "decode",
            {"MODEL_PATH": "/m", "HICACHE_RATIO": "2"},
            ["HICACHE_RATIO", "ENABLE_HICACHE=1"],
        ),
        ("prefill", {"MODEL_PATH": "/m", "DISAGG_BOOTSTRAP_PORT": "x"}, ["DISAGG_BOOTSTRAP_PORT"]),
        (
            "router",
            {"PREFILL_URLS": "10.0.0.1:30000", "DECODE_URLS": "http://d:1"},
            ["PREFILL_URLS", "10.0.0.1:30000"],
        ),
        ("router", {"PREFILL_URLS": "http://p:1@99999", "DECODE_URLS": "http://d:1"}, ["99999"]),
        (
            "router",
            {"PREFILL_URLS": " , ", "DECODE_URLS": "http://d:1"},
            ["PREFILL_URLS", "no URL"],
        ),
        ("serve", {}, ["unknown role 'serve'"]),
    ],
)
def test_a_bad_value_stops_with_one_line(role, env, words):
    assert_one_line_error(run(ENTRYPOINT, role, "--dry-run", env=env), *words)


@pytest.mark.parametrize("role", ["decode", "prefill", "status", "plan"])
def test_an_index_k_dtype_the_plugin_refuses_stops_every_role_that_reads_it(role):
    env = {"MODEL_PATH": "/m", DTYPE_ENV: "int4"}
    assert_one_line_error(
        run(ENTRYPOINT, role, "--dry-run", env=env),
        f"sglang-dsv4 {role}: {DTYPE_ENV}='int4' is not supported; allowed: fp8, bf16, fp4",
    )


@pytest.mark.parametrize("role", ["decode", "status"])
def test_an_unknown_fix_id_to_skip_stops_with_the_known_ids(role):
    from sglang_dsv4.fixes import ids

    env = {"MODEL_PATH": "/m", "SGLANG_DSV4_SKIP_FIXES": "index-k-bf16,bogus-id"}
    result = run(ENTRYPOINT, role, "--dry-run", env=env)
    assert_one_line_error(result, "SGLANG_DSV4_SKIP_FIXES names no fix 'bogus-id'", *ids())
    # A known id passes.
    env["SGLANG_DSV4_SKIP_FIXES"] = "index-k-bf16"
    assert run(ENTRYPOINT, role, "--dry-run", env=env).returncode == 0


def test_hicache_choices_are_checked_against_upstreams_parser():
    from sglang.srt.server_args import ServerArgs

    parser = StrictParser()
    ServerArgs.add_cli_args(parser)
    (policy,) = (a for a in parser._actions if "--hicache-write-policy" in a.option_strings)
    env = {"MODEL_PATH": "/m", "ENABLE_HICACHE": "1", "HICACHE_WRITE_POLICY": "foo"}
    assert_one_line_error(
        run(ENTRYPOINT, "decode", "--dry-run", env=env),
        "sglang-dsv4 decode: HICACHE_WRITE_POLICY='foo' is not one of upstream's choices for "
        f"--hicache-write-policy: {', '.join(policy.choices)}",
    )


def test_no_role_is_one_line_and_help_lists_every_variable():
    assert_one_line_error(run(ENTRYPOINT, env={}), "no role given")
    help_text = run(ENTRYPOINT, "--help", env={}).stdout
    script = ENTRYPOINT.read_text()
    # Every variable the script reads (outside its own locals) is documented in --help.
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]+)[:}]", script))
    read |= set(re.findall(r"\b(?:require|optional_flag|is_on) ([A-Z][A-Z0-9_]+)", script))
    read -= {"ROLES"}
    undocumented = sorted(name for name in read if name not in help_text)
    assert not undocumented and len(read) > 15, undocumented


# --- bare-metal launchers ------------------------------------------------------------------


@pytest.mark.parametrize("role", sorted(LAUNCHERS))
def test_launchers_run_the_entrypoint_itself(role):
    env = {
        "MODEL_PATH": "/m",
        "PREFILL_URLS": "http://p:30000",
        "DECODE_URLS": "http://d:30001",
        "EXTRA_ARGS": "--log-level debug",
    }
    via_script = dry_run("--dry-run", "--port", "40000", env=env, script=LAUNCHERS[role])
    assert via_script == dry_run(role, "--dry-run", "--port", "40000", env=env)
    # No second copy of the mapping: the launcher names no upstream command or flag.
    text = LAUNCHERS[role].read_text()
    assert "sglang.launch_server" not in text and "--disaggregation" not in text
    # A missing variable reads the same through the launcher.
    if role != "router":
        assert_one_line_error(run(LAUNCHERS[role], env={}), "MODEL_PATH")


# --- health --------------------------------------------------------------------------------


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the handler API's name)
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.skipif(not shutil.which("curl"), reason="the health role probes with curl")
def test_health_role_probes_the_server_this_container_started(tmp_path, health_server):
    health_file = tmp_path / "health-url"
    env = {
        "SGLANG_DSV4_HEALTH_FILE": str(health_file),
        "MODEL_PATH": "/m",
        "PORT": str(health_server),
        "PYTHON": "true",
    }  # `true` stands in for the server
    # Nothing started yet: unhealthy (Docker reads 1 as unhealthy and reserves 2).
    assert_one_line_error(run(ENTRYPOINT, "health", env=env), "no server role", rc=1)
    # A serving role records where its server answers, then hands over to the server.
    assert run(ENTRYPOINT, "decode", env=env).returncode == 0
    assert health_file.read_text().strip() == f"http://127.0.0.1:{health_server}/health"
    assert run(ENTRYPOINT, "health", env=env).returncode == 0
    health_file.write_text(f"http://127.0.0.1:{health_server}/not-ready\n")
    assert run(ENTRYPOINT, "health", env=env).returncode == 1


# --- compose -------------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set: the default; `${VAR:?err}`: a stand-in."""
    value = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))
    return re.sub(r"\$\{[A-Z0-9_]+:\?[^}]*\}", "/host/model", value)


def service_env(service: dict) -> dict[str, str]:
    return {k: interpolate(v) for k, v in service.get("environment", {}).items()}


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert [d["driver"] for d in devices] == ["nvidia"] and devices[0]["capabilities"] == ["gpu"]
    return devices[0]["device_ids"]


def test_compose_has_the_three_roles_with_health_checks_and_start_order():
    services = compose()["services"]
    assert set(services) == {"prefill", "decode", "router"}
    for name, service in services.items():
        assert service["command"] == [name], "each service runs the entrypoint role of its name"
        test = service["healthcheck"]["test"]
        assert test == ["CMD", "/opt/sglang-dsv4/entrypoint.sh", "health"]
        assert service["network_mode"] == "host"
    router = services["router"]
    assert router["depends_on"] == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    assert "deploy" not in router  # the router needs no GPU
    prefill, decode = (service_env(services[n]) for n in ("prefill", "decode"))
    # GPU sets split, each as large as its tensor-parallel size.
    p_gpus, d_gpus = gpu_ids(services["prefill"]), gpu_ids(services["decode"])
    assert not set(p_gpus) & set(d_gpus)
    assert (len(p_gpus), len(d_gpus)) == (int(prefill["TP"]), int(decode["TP"]))
    # Both sides store index keys alike; distinct ports on the shared host network.
    assert prefill[DTYPE_ENV] == decode[DTYPE_ENV] == "bf16"
    assert prefill["PORT"] != decode["PORT"] and prefill["NCCL_PORT"] != decode["NCCL_PORT"]
    assert services["prefill"]["image"] == services["decode"]["image"] == router["image"]


def test_compose_services_through_the_entrypoint_parse_with_upstream(parse_server, parse_router):
    services = compose()["services"]
    envs = {name: service_env(service) for name, service in services.items()}
    for role in ("prefill", "decode"):
        dtype, argv = server_argv(dry_run(role, "--dry-run", env=envs[role]))
        args = parse_server(argv)
        assert (args.disaggregation_mode, args.model_path) == (role, "/model")
        assert args.port == int(envs[role]["PORT"])
    prefill = parse_server(server_argv(dry_run("prefill", "--dry-run", env=envs["prefill"]))[1])
    router = parse_router(router_argv(dry_run("router", "--dry-run", env=envs["router"])))
    # The router reaches the servers where they listen, with the prefill's bootstrap port.
    assert router.prefill_urls == [
        (f"http://127.0.0.1:{prefill.port}", prefill.disaggregation_bootstrap_port)
    ]
    assert router.decode_urls == [f"http://127.0.0.1:{envs['decode']['PORT']}"]
    assert router.port == int(envs["router"]["PORT"])


# --- the Dockerfile: one source of versions ------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in project["dependencies"]:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canonicalize_name(req.name)] = exact[0]
    return pins


def test_the_dockerfile_installs_the_project_and_states_no_version_of_its_own():
    pins = pyproject_pins()
    for name in ("sglang", "torch", "nixl", "sglang-router"):
        assert name in pins, f"pyproject.toml must pin {name} exactly (the image's one source)"
    runs = [args for word, args in dockerfile_instructions() if word == "RUN"]
    assert any(re.search(r"\bpip install (--[a-z-]+ )*\.(\s|$)", r) for r in runs), (
        "the image installs this repository"
    )
    # Any `name==version` in the Dockerfile must be pyproject's own pin for that name.
    stated = re.findall(
        r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([0-9][^\s\"'\\]*)", DOCKERFILE.read_text()
    )
    for name, found in stated:
        key = canonicalize_name(name)
        assert key in pins, f"the Dockerfile pins {name}, which pyproject.toml does not"
        assert found == pins[key], f"{name}: Dockerfile {found}, pyproject.toml {pins[key]}"


def test_the_dependency_layer_installs_exactly_pyprojects_dependencies(tmp_path):
    # The layer the image builds before the project (so a code change does not rebuild 12 GB)
    # installs what its own command reads out of pyproject.toml: run that command here.
    steps = dockerfile_instructions()
    layer = next(a for w, a in steps if w == "RUN" and "tomllib" in a)
    command = re.search(r"(python3 -c '[^']*')\s*<\s*pyproject\.toml\s*>\s*(\S+)", layer)
    assert command, layer
    assert re.search(rf"pip install -r {re.escape(command[2])}(\s|$)", layer)
    # pyproject.toml is the only project file the layer can see (copied just before it).
    copies = [a for w, a in steps[: steps.index(("RUN", layer))] if w == "COPY"]
    assert copies == ["pyproject.toml ./"]
    argv = shlex.split(command[1])
    argv[0] = sys.executable
    out = subprocess.run(argv, stdin=(REPO / "pyproject.toml").open("rb"), capture_output=True,
                         text=True, check=True).stdout
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert out.splitlines() == project["dependencies"]


def test_the_pins_are_what_this_install_runs():
    # The project's own install (this venv, CI's) resolves to pyproject's pins, and flashinfer
    # to the version sglang itself pins, so the image, which installs the same way, gets them too.
    for name, pinned in pyproject_pins().items():
        assert version(name) == pinned, name
    flashinfer = [Requirement(r) for r in requires("sglang") or []]
    flashinfer = [r for r in flashinfer if canonicalize_name(r.name) == "flashinfer-python"]
    assert flashinfer and version("flashinfer-python") in flashinfer[0].specifier


def test_the_base_image_is_the_cuda_line_torch_is_built_for():
    import torch

    args = dict(a.split("=", 1) for w, a in dockerfile_instructions() if w == "ARG" and "=" in a)
    image = args["CUDA_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu\d+\.\d+", image)
    assert match, f"not a pinned nvidia/cuda devel tag: {image}"
    assert f"{match[1]}.{match[2]}" == torch.version.cuda == "13.0"
    froms = [a for w, a in dockerfile_instructions() if w == "FROM"]
    # One stage: serving needs the compilers anyway, and a second would copy the environment.
    assert froms == ["${CUDA_IMAGE}"]


def test_the_runtime_stage_defaults_checks_and_runs_the_entrypoint():
    from sglang_dsv4.settings import parse_index_k_dtype

    steps = dockerfile_instructions()
    runtime = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]
    text = "\n".join(f"{w} {a}" for w, a in runtime)
    # sm_120 by default, in force in the stage; compose builds with the same default.
    global_args = steps[: next(i for i, (w, _) in enumerate(steps) if w == "FROM")]
    assert ("ARG", "TORCH_CUDA_ARCH_LIST=12.0") in global_args
    body = " ".join(f"{w} {a}" for w, a in runtime[1:])
    assert "ARG TORCH_CUDA_ARCH_LIST" in body
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in body
    compose_args = compose()["services"]["prefill"]["build"]["args"]
    assert interpolate(compose_args["TORCH_CUDA_ARCH_LIST"]) == "12.0"
    # bf16 index keys: the image's default, the same as the entrypoint's on bare metal.
    image_dtype = re.search(rf"\b{DTYPE_ENV}=(\S+)", text)[1]
    assert parse_index_k_dtype(image_dtype) == image_dtype == "bf16"
    assert server_argv(dry_run("decode", "--dry-run", env={"MODEL_PATH": "/m"}))[0] == image_dtype
    # A non-root numeric user, set before the build-time check so the check runs as it.
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root") and users[-1][0].isdigit()
    check = [
        i for i, (w, a) in enumerate(runtime) if w == "RUN" and a == "sglang-dsv4 status --strict"
    ]
    user_at = max(i for i, (w, _) in enumerate(runtime) if w == "USER")
    assert check and check[0] > user_at, "the strict status check runs in the shipped stage"
    assert ("ENTRYPOINT", '["/opt/sglang-dsv4/entrypoint.sh"]') in runtime
    assert any(
        w == "HEALTHCHECK" and a.endswith('CMD ["/opt/sglang-dsv4/entrypoint.sh", "health"]')
        for w, a in runtime
    )
    assert "COPY --chmod=755 docker/entrypoint.sh /opt/sglang-dsv4/entrypoint.sh" in text


# --- docker/README.md: the two-host deployment it shows --------------------------------------


def readme_section(title: str) -> str:
    text = (DOCKER / "README.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def shell_commands(section: str) -> list[list[str]]:
    """Each command of the section's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def docker_run(words: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """(environment, role, docker options) of a `docker run ... IMAGE ROLE` command."""
    assert words[:2] == ["docker", "run"], words
    env, options, i = {}, [], 2
    while words[i].startswith("-"):
        if words[i] == "-e":
            key, _, value = words[i + 1].partition("=")
            env[key] = value
        options.append(words[i])
        takes_value = words[i] in {"-e", "-v", "--name", "--gpus", "--network", "--ipc"}
        takes_value |= words[i] in {"--ulimit", "--device"}
        if takes_value:
            options.append(words[i + 1])
        i += 2 if takes_value else 1
    assert words[i] == "sglang-dsv4-sm120", words
    return env, words[i + 1], options


def test_two_host_commands_in_the_readme_render_and_agree(parse_server, parse_router):
    commands = shell_commands(readme_section("Two hosts"))
    runs = {}
    for words in commands:
        if words[:2] == ["docker", "run"]:
            env, role, options = docker_run(words)
            runs[role] = (env, options)
    assert set(runs) == {"prefill", "decode", "router"}
    address = {}
    for role in ("prefill", "decode"):
        env, options = runs[role]
        # Host networking, the RDMA devices, and the advertised address set explicitly.
        assert options[options.index("--network") + 1] == "host"
        assert "/dev/infiniband" in options
        args = parse_server(server_argv(dry_run(role, "--dry-run", env=env))[1])
        assert args.tp_size == 4  # 4 RTX PRO 6000 per host
        assert args.disaggregation_mode == role
        address[role] = env["SGLANG_HOST_IP"]
        port = args.port
        address[f"{role}_url"] = f"http://{env['SGLANG_HOST_IP']}:{port}"
    assert address["prefill"] != address["decode"]
    env, options = runs["router"]
    router = parse_router(router_argv(dry_run("router", "--dry-run", env=env)))
    assert router.prefill_urls == [(address["prefill_url"], 8998)]
    assert router.decode_urls == [address["decode_url"]]
    # The liveness commands probe those hosts, not 127.0.0.1.
    from sglang_dsv4.acceptance.liveness import build_parser

    (liveness,) = [w for w in commands if w[:2] == ["sglang-dsv4", "liveness"]]
    probe = build_parser().parse_args(liveness[2:])
    assert probe.prefill == [address["prefill_url"]]
    assert probe.decode == [address["decode_url"]]
    assert probe.router == [f"http://{address['prefill']}:{router.port}"]
    curls = [w[-1] for w in commands if w[:2] == ["curl", "-fsS"]]
    assert curls and not any("127.0.0.1" in url for url in curls)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"IB_DEVICE": "mlx5_0:1"}, ["IB_DEVICE", "without a port", "mlx5_0:1"]),
        ({"IB_DEVICE": "mlx5_0", "UCX_NET_DEVICES": "mlx5_0:1"}, ["UCX_NET_DEVICES", "IB_DEVICE"]),
    ],
)
def test_rdma_device_settings_upstream_would_ignore_or_refuse_stop_at_once(env, words):
    result = run(ENTRYPOINT, "prefill", "--dry-run", env={"MODEL_PATH": "/m", **env})
    assert_one_line_error(result, *words)


def test_advertising_a_nic_without_netifaces_stops_at_once():
    import importlib.util

    if importlib.util.find_spec("netifaces") is not None:
        pytest.skip("netifaces is installed here: upstream can read SGLANG_LOCAL_IP_NIC")
    result = run(
        ENTRYPOINT, "decode", "--dry-run", env={"MODEL_PATH": "/m", "SGLANG_LOCAL_IP_NIC": "ib0"}
    )
    assert_one_line_error(result, "SGLANG_LOCAL_IP_NIC needs the netifaces package")
