"""Run Python as a fresh interpreter would, without paying for its third-party imports each time.

Upstream's modules import torch, transformers, triton and a dozen more libraries: some 12 of the
13 CPU-seconds a fresh `python -c "import sglang.srt..."` spends before it runs anything. Checks
that need a fresh process for SGLang (the plugin loader and HookRegistry run once per process;
a probe must import an upstream tree alone) would pay that every time. Here they are forked from
a server process, started at the first run, that imported those libraries once and nothing of
SGLang or of this distribution; there is one server per value of what the libraries read from
the environment at import (READ_AT_IMPORT). Each run imports SGLang anew, with its own
environment, working directory, `sys.path` (as `python` builds it from the argv and
PYTHONPATH), `sys.argv`, `__main__`, stdin from /dev/null, exit status and output, like
`subprocess.run(capture_output=True, text=True)`. What it cannot be is an interpreter started
with other interpreter options, or one that must set something before a preloaded library is
imported: `run` takes only `-c CODE`, `-m MODULE` and `SCRIPT` argvs.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

# Imported once in the server: third-party libraries only. None of them imports SGLang or this
# distribution (each child checks); one that is not installed is left out.
PRELOAD = (
    "torch",
    "transformers",
    "triton",
    "numpy",
    "scipy",
    "sympy",
    "networkx",
    "torchvision",
    "ml_dtypes",
    "cutlass",
    "flashinfer",
    "aiohttp",
    "fastapi",
    "uvicorn",
    "pydantic",
    "zmq",
    "huggingface_hub",
    "compressed_tensors",
    "requests",
    "psutil",
)

# Imported anew by each run, never by the server: upstream, its kernels, and this distribution.
OURS = ("sglang", "sgl_kernel", "sglang_dsv4", "sgl_kernel_dsv4")


def _ours(name: str) -> bool:
    return name.split(".", 1)[0] in OURS


# --- the server (this file run as a script) and its children ----------------------------------


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as the interpreter does with SystemExit("message")
    return 1


def _run_child(request: dict, base_sys_path: list[str]) -> int:
    """In the forked child: become the fresh interpreter `request` describes and run it."""
    os.setsid()  # its own process group: a timeout kills what it started, too
    streams = ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
               (2, request["err"], os.O_WRONLY))
    for fd, path, mode in streams:
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.stdout = open(1, "w", buffering=1 if env.get("PYTHONUNBUFFERED") else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(0, closefd=False)
    argv = request["argv"]
    kind, rest = argv[0], argv[1:]
    if kind == "-c":
        head = ""
    elif kind == "-m":
        head = os.getcwd()
    else:
        head = str(Path(kind).resolve().parent)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # As the interpreter builds it: argv's directory, then what .pth files put in front, then
    # PYTHONPATH, then the standard library (it starts with pythonXY.zip) and site-packages.
    stdlib = f"python{sys.version_info.major}{sys.version_info.minor}.zip"
    at = next((i for i, p in enumerate(base_sys_path) if p.endswith(stdlib)), 0)
    sys.path[:] = [head, *base_sys_path[:at], *extra, *base_sys_path[at:]]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    code = 0
    try:
        preloaded = sorted(name for name in sys.modules if _ours(name))
        if preloaded:
            raise RuntimeError(f"warm_python: the server imported {', '.join(preloaded)}")
        if kind == "-c":
            sys.argv = ["-c", *rest[1:]]
            exec(compile(rest[0], "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv = [rest[0], *rest[1:]]  # runpy puts the module's file in argv[0]
            runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [kind, *rest]
            runpy.run_path(kind, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as at interpreter exit: non-daemon threads are joined
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _serve() -> None:
    """One request per line on stdin; for each, "started PID" then "exited PID CODE" on stdout."""
    base_sys_path = sys.path[1:]  # as a fresh interpreter has it, past this script's directory
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            code = 1
            try:
                code = _run_child(request, base_sys_path)
            finally:
                os._exit(code & 0xFF if code >= 0 else 1)
        print(f"started {pid}", file=replies)
        _, status = os.waitpid(pid, 0)
        print(f"exited {pid} {os.waitstatus_to_exitcode(status)}", file=replies)


# --- the caller --------------------------------------------------------------------------------

# What the preloaded libraries (and the interpreter) read from the environment once, at start or
# at import: thread pools (OMP_NUM_THREADS is read when torch is imported), Triton's interpreter
# switch, Hugging Face's offline and cache settings, CUDA's device list, PYTHONHASHSEED. A child
# whose environment differs from a server's in any of these is forked from a server started
# with its own values; PYTHONPATH (each child sets its sys.path) and PYTHONUNBUFFERED (its
# streams) are the child's to set.
READ_AT_IMPORT = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "TORCH", "PYTORCH_", "TRITON_",
                  "CUDA_", "NVIDIA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_",
                  "PYTHON", "LD_", "MALLOC_")
CHILD_SETS = ("PYTHONPATH", "PYTHONUNBUFFERED")

_servers: dict[tuple, subprocess.Popen] = {}
_lock = threading.Lock()


def import_env(env: dict) -> tuple:
    """The part of `env` that a process reads once: a server is started per distinct value."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(READ_AT_IMPORT) and k not in CHILD_SETS))


def _started_server(env: dict) -> subprocess.Popen:
    key = import_env(env)
    server = _servers.get(key)
    if server is None or server.poll() is not None:
        # The caller's environment, with the child's values of what is read at import.
        base = {k: v for k, v in os.environ.items() if not k.startswith(READ_AT_IMPORT)}
        server = _servers[key] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**base, **dict(key)}, cwd="/",
        )
    return server


def run(argv: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`, forked warm.
    `env` replaces the environment (default: this process's); on timeout the child's process
    group is killed and subprocess.TimeoutExpired raised."""
    runnable = argv and (argv[0] in ("-c", "-m") and len(argv) >= 2 or not argv[0].startswith("-"))
    if not runnable:
        raise ValueError(f"warm_python.run takes -c CODE, -m MODULE or SCRIPT, not {argv[:1]}")
    command = [sys.executable, *argv]
    with _lock, tempfile.TemporaryDirectory(prefix="sglang-dsv4-warm-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        env = dict(os.environ if env is None else env)
        server = _started_server(env)
        request = {"argv": list(argv), "env": env,
                   "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        started = server.stdout.readline().split()
        if started[:1] != ["started"]:
            raise RuntimeError(f"warm_python: the server did not start {command[:3]} ({started})")
        pid = int(started[1])
        timer, fired = None, threading.Event()
        if timeout is not None:
            timer = threading.Timer(timeout, _kill_group, (pid, fired))
            timer.start()
        try:
            exited = server.stdout.readline().split()
        finally:
            if timer is not None:
                timer.cancel()
        if exited[:2] != ["exited", str(pid)]:
            raise RuntimeError(f"warm_python: the server lost {command[:3]} ({exited})")
        code = int(exited[2])
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if fired.is_set():
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, code, stdout, stderr)


def _kill_group(pid: int, fired: threading.Event) -> None:
    fired.set()
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _serve()
