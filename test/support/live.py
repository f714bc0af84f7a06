"""Real servers on loopback for end-to-end tests: `launch_server`, PD pairs and the router.

Each process runs in a process group of its own (so a server's scheduler and detokenizer children
go with it), on a free loopback port, logging into a file; `ready` waits for /health (and, for a
server, one real generation through /health_generate), and fails at once, with the log's tail,
if the process exits first. `stop` sends SIGTERM to the group, then SIGKILL after a grace period,
and waits; a `Fleet` stops everything it started, in reverse order, whatever happened.

A start is mostly one process importing and building on one core: servers launched together
(`wait=False`, then `ready()`) start side by side on this 2-core machine, and a PD pair's
prefill, decode and router always do.

    with Fleet(tmp) as fleet:
        one = fleet.server(model_dir)                        # python -m sglang.launch_server
        pd = fleet.pd(model_dir)                             # prefill + decode + sglang_router
        a, b = fleet.server(model_dir, wait=False), fleet.server(model_dir, wait=False)
        a.ready(), b.ready()                                 # both started at once
        client = one.openai()
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# How long a CPU server may take to come up on a loaded 2-core machine. Not a speed assertion:
# exceeding it fails the start with the log's tail, so a hang cannot stall the suite.
START_TIMEOUT_S = float(os.environ.get("SGLANG_DSV4_E2E_START_TIMEOUT", "600"))
STOP_GRACE_S = 20.0

# What every CPU server of the suite shares: loopback only, no CUDA graphs or warm-up stand-ins,
# a small pool so the suite's prefixes compete for it.
BASE_ARGS = ["--device", "cpu", "--log-level", "info"]  # --host: Fleet.server


_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one handed out before in this process: servers launched
    together bind theirs only later, and the kernel may offer a released port again."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    # The worktree (or checkout) first on the path, as the test process has it, so every server
    # and scheduler loads the same distribution and plugin.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("SGLANG_DSV4_INDEX_K_DTYPE", "fp8")
    # The plugin records its CPU-backend decision in the environment of the process that loaded
    # it (here: the test process, "0", no --device cpu); a server decides from its own command
    # line, as `launch_server --device cpu` does on its own.
    env.pop("SGLANG_DSV4_CPU_BACKEND", None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


class StartFailed(RuntimeError):
    pass


@dataclass
class Proc:
    """One process group started by the harness."""

    name: str
    command: list[str]
    log: Path
    port: int
    env: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    host: str = "127.0.0.1"  # where this host reaches it
    ready_paths: tuple[str, ...] = ("/health",)  # what answers 200 once it is up
    is_ready: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def launch(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log, "ab")
        self.popen = subprocess.Popen(
            self.command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_env(self.env),
            start_new_session=True,  # its own process group: stop() takes its children too
        )
        handle.close()
        return self

    def log_since(self, mark: int) -> str:
        """What the process logged after byte `mark` of its log."""
        return self.log.read_bytes()[mark:].decode("utf-8", "replace")

    def wait_log(self, mark: int, needle: str, timeout: float) -> str:
        """The log written after byte `mark`, once it holds `needle` (bounded; the process must
        stay alive meanwhile)."""
        deadline = time.monotonic() + timeout
        while needle not in (text := self.log_since(mark)):
            assert self.alive(), f"{self.name} exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name}: no {needle!r} in {timeout:.0f} s"
            time.sleep(0.05)
        return text

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the live processes of its group (from /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:  # the process exited meanwhile
                continue
            # After the command: state, ppid, pgrp, ..., utime (12th), stime (13th).
            if self.popen is not None and int(fields[2]) == self.popen.pid:
                total += int(fields[11]) + int(fields[12])
        return total / ticks

    def ready(self) -> Proc:
        """Once its ready paths answer (at once if they did before)."""
        if not self.is_ready:
            self.wait_ready(self.ready_paths)
            self.is_ready = True
        return self

    def wait_ready(self, paths: tuple[str, ...], timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        pending = list(paths)
        while pending:
            if not self.alive():
                code = self.popen.returncode if self.popen else None
                raise StartFailed(f"{self.name} exited ({code}) before {pending[0]} answered:\n"
                                  f"{self.tail()}")
            if time.monotonic() > deadline:
                raise StartFailed(f"{self.name}: {pending[0]} did not answer within {timeout:.0f}"
                                  f" s:\n{self.tail()}")
            try:
                status, _ = _get(self.url + pending[0], timeout=60)
            except (OSError, urllib.error.URLError):
                status = None
            if status == 200:
                pending.pop(0)
            else:
                time.sleep(0.5)

    def wait_workers(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """A router: until `count` workers are registered and healthy. Its /health answers
        before it has registered them (it does so in the background), and a request sent then
        never reaches a worker."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, body = _get(self.url + "/readiness")
                healthy = json.loads(body).get("healthy_workers", 0) if status == 200 else 0
            except (OSError, urllib.error.URLError, ValueError):
                healthy = 0
            if healthy >= count:
                return
            if not self.alive() or time.monotonic() > deadline:
                raise StartFailed(f"{self.name}: {healthy} of {count} workers healthy:\n"
                                  f"{self.tail()}")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the process group, without waiting (`stop` waits)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)

    def stop(self) -> int | None:
        """End the process group: SIGTERM, then SIGKILL after the grace period. Its exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # Children that outlive the leader (a scheduler) are in the same group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(STOP_GRACE_S)
        return self.popen.returncode

    # --- clients -------------------------------------------------------------------------------

    def openai(self, timeout: float = 600.0):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=timeout,
                             max_retries=0)

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read().decode("utf-8", "replace")
        try:
            return json.loads(body)
        except ValueError:  # /flush_cache answers plain text
            return {"text": body}

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        return _get(self.url + path, timeout)


@dataclass
class PD:
    prefill: Proc
    decode: Proc
    router: Proc
    is_ready: bool = False

    def ready(self) -> PD:
        """Once both servers answer and the router has registered them as healthy."""
        if not self.is_ready:
            self.prefill.ready()
            self.decode.ready()
            self.router.ready()
            self.router.wait_workers(2)
            self.is_ready = True
        return self

    @property
    def url(self) -> str:
        return self.router.url

    def openai(self, timeout: float = 600.0):
        return self.router.openai(timeout)

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        return self.router.post(path, body, timeout)


class Fleet:
    """Everything started through it is stopped when the block ends (reverse order)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.procs: list[Proc] = []
        self._stopping: list[threading.Thread] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for thread in self._stopping:
            thread.join()
        procs, self.procs = self.procs[::-1], []
        _stop_together(procs)

    def _start(self, name: str, command: list[str], port: int, env: dict | None,
               ready: tuple[str, ...], host: str = "127.0.0.1", wait: bool = True) -> Proc:
        proc = Proc(name, command, self.workdir / f"{name}.log", port, env or {}, host=host,
                    ready_paths=ready)
        self.procs.append(proc)
        proc.launch()
        return proc.ready() if wait else proc

    def retire(self, *procs: Proc, clean: bool = True, wait: bool = False) -> None:
        """Stop servers a test module is done with: each CPU server holds about 2.4 GB here and
        the suite's would not all fit at once. With `clean`, each one's sanitizer first reports
        0 violations (test_zz_sanitizer reads only the servers still running). They are sent
        SIGTERM now; a server takes some 6 s to shut down, waited out in the background unless
        `wait` (and always by the end of the fleet)."""
        try:
            if clean:
                report = {p.name: sanitizer_counts(p) for p in procs if p.alive()}
                dirty = {n: c for n, c in report.items() if c is None or sum(c.values())}
                assert not dirty, f"sanitizer violations on retired servers: {dirty}"
        finally:
            if wait:
                _stop_together(list(procs))
            else:
                stopping = threading.Thread(target=_stop_together, args=(list(procs),),
                                            name="fleet-retire", daemon=True)
                stopping.start()
                self._stopping.append(stopping)

    def server(self, model_dir: Path | str, *args: str, name: str = "server",
               env: dict | None = None, generate_check: bool = True, guest=None,
               host: str = "127.0.0.1", wait: bool = True) -> Proc:
        """A server on this host (listening on `host`), or on `guest` (support.netns.GuestHost,
        listening on its address). With `wait=False` it is launched only: `ready()` waits."""
        port = free_port()
        if guest is not None:
            host = guest.address
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                   "--port", str(port), *BASE_ARGS, *args, "--host", host]
        if guest is not None:
            command = guest.command(command)
        ready = ("/health", "/health_generate") if generate_check else ("/health",)
        return self._start(name, command, port, env, ready, host=host, wait=wait)

    def pd(self, model_dir: Path | str, *args: str, env: dict | None = None,
           transfer_backend: str = "nixl", name: str = "pd", decode_guest=None,
           wait: bool = True) -> PD:
        """A prefill server, a decode server and sglang_router in PD mode, on loopback, all three
        launched at once; with `decode_guest` (support.netns.GuestHost) the decode runs there, and
        the prefill listens on the address it advertises to its peers (upstream's
        get_local_ip_auto). With `wait=False` they are launched only: `ready()` waits."""
        bootstrap = free_port()
        common = ["--disaggregation-transfer-backend", transfer_backend, *args]
        prefill_host = "127.0.0.1"
        if decode_guest is not None:
            from sglang.srt.utils.network import get_local_ip_auto

            prefill_host = get_local_ip_auto()
        prefill = self.server(model_dir, "--disaggregation-mode", "prefill",
                              "--disaggregation-bootstrap-port", str(bootstrap), *common,
                              name=f"{name}-prefill", env=env, generate_check=False,
                              host=prefill_host, wait=False)
        decode = self.server(model_dir, "--disaggregation-mode", "decode", *common,
                             name=f"{name}-decode", env=env, generate_check=False,
                             guest=decode_guest, wait=False)
        port = free_port()
        router = self._start(
            f"{name}-router",
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--host", "127.0.0.1", "--port", str(port),
             "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
             "--policy", "round_robin",
             # its metrics port too: the default (29000) is taken by any other router here, and
             # a router that cannot bind it never answers at all
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             # it starts beside its workers and registers them once they answer: look every
             # second, not every 30 (its default)
             "--worker-startup-check-interval", "1"],
            port, env, ("/health",), wait=False)
        pair = PD(prefill, decode, router)
        return pair.ready() if wait else pair


def _stop_together(procs: list[Proc]) -> None:
    """Stop processes whose grace periods overlap: SIGTERM to all, then each waited for (and
    SIGKILLed after its grace period) in turn."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


# The sanitizer watches all of the suite's traffic: on in every server, every decode step sampled.
SANITIZED = {"SGLANG_DSV4_SANITIZE": "1", "SGLANG_DSV4_SANITIZE_SAMPLE": "1.0"}
# Metrics carry the sanitizer's counter; a fixed seed for anything the server samples.
# A CPU forward of a long prompt can outlast upstream's watchdogs (300 s), which would kill the
# server mid-request: they are lengthened, not a speed bound.
# No --sleep-on-idle: the plugin gives every CPU server that flag by itself (an idle upstream
# scheduler polls its queues without pause), and test_single checks the plain server rests.
SERVER_ARGS = ("--enable-metrics", "--random-seed", "0", "--watchdog-timeout", "3600",
               "--soft-watchdog-timeout", "3600")
# The pools: on the CPU upstream sizes them from the host's free memory (some 14 GB here, which
# the sanitizer's start-up poisoning would touch page by page). The suite's servers take what
# its traffic needs: 64 sessions of up to 4096 tokens sharing a 3500-token prefix, each running
# request holding its window (128) and a page (256) of the SWA pool.
POOL_ARGS = ("--max-total-tokens", "131072", "--swa-full-tokens-ratio", "0.25",
             "--max-running-requests", "64")


def env_for(index_k_dtype: str, **extra) -> dict:
    return {**SANITIZED, "SGLANG_DSV4_INDEX_K_DTYPE": index_k_dtype, **extra}


# --- traffic -------------------------------------------------------------------------------------


def prompt_ids(seed: int, length: int, low: int = 40, high: int = 1000) -> list[int]:
    """A seeded prompt of `length` ordinary token ids (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


def generate(target, input_ids: list[int], max_new_tokens: int, top_logprobs: int = 0,
             timeout: float = 900.0) -> dict:
    """One greedy /generate: {"ids": output ids, "top": [[(id, logprob), ...] per step],
    "cached": prompt tokens served from the cache}."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                            "ignore_eos": True},
    }
    if top_logprobs:
        body.update(return_logprob=True, top_logprobs_num=top_logprobs, logprob_start_len=-1)
    reply = target.post("/generate", body, timeout=timeout)
    meta = reply.get("meta_info", {})
    ids = reply.get("output_ids")
    if ids is None:
        ids = [entry[1] for entry in meta.get("output_token_logprobs", [])]
    top = [[(entry[1], entry[0]) for entry in step] for step in meta.get("output_top_logprobs") or []]
    return {"ids": list(ids), "top": top, "cached": meta.get("cached_tokens", 0),
            "text": reply.get("text", "")}


def sanitizer_counts(target) -> dict | None:
    """{kind: violations} from a server's /metrics (None: the sanitizer's counter is absent)."""
    from sglang_dsv4.acceptance.release_gate import parse_metrics

    status, text = target.get("/metrics")
    if status != 200:
        raise RuntimeError(f"{target.url}/metrics answered HTTP {status}")
    return parse_metrics(text)["sanitizer"]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def serves_like_plain_and_clean(pd, plain, seed: int) -> None:
    """After a PD canary: the pair serves the next prompt with the plain server's tokens, and
    the decode's sanitizer saw nothing (late_write: no page the decode gave up changed before
    reuse)."""
    prompt = prompt_ids(seed=seed, length=600)
    plain.post("/flush_cache", {})
    alone = generate(plain, prompt, max_new_tokens=12)
    split = generate(pd, prompt, max_new_tokens=12)
    assert first_divergence(alone["ids"], split["ids"]) is None, (alone["ids"], split["ids"])
    counts = sanitizer_counts(pd.decode)
    assert counts is not None and "late_write" in counts, counts
    assert sum(counts.values()) == 0, counts
