"""`sglang_dsv4.warm_python` against the real interpreter: what a case run warm sees (argv,
sys.path, working directory, environment, `__main__`, exit status, output) is what
`subprocess.run([sys.executable, ...])` gives, and nothing of SGLang is imported before it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from sglang_dsv4 import warm_python

SEEN = textwrap.dedent(
    """
    import json, os, sys
    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "sglang_dsv4"))
    print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                      "env": os.environ.get("WARM_CASE"), "ours": ours}))
    """
)


def both(argv, **kwargs):
    cold = subprocess.run([sys.executable, *argv], capture_output=True, text=True, **kwargs)
    warm = warm_python.run(argv, **kwargs)
    return cold, warm


@pytest.mark.parametrize("kind", ["-c", "-m", "script"])
def test_a_warm_run_sees_what_a_fresh_interpreter_sees(kind, tmp_path):
    (tmp_path / "seen.py").write_text(SEEN)
    argv = {"-c": ["-c", SEEN, "a b"], "-m": ["-m", "seen", "x"],
            "script": [str(tmp_path / "seen.py"), "y"]}[kind]
    env = {**os.environ, "WARM_CASE": kind, "PYTHONPATH": str(tmp_path)}
    cold, warm = both(argv, env=env, cwd=tmp_path)
    assert cold.returncode == warm.returncode == 0, (cold.stderr[-2000:], warm.stderr[-2000:])
    assert warm.stdout == cold.stdout
    assert '"ours": []' in warm.stdout and f'"env": "{kind}"' in warm.stdout


@pytest.mark.parametrize(
    "code, status",
    [("import sys; sys.exit(3)", 3), ("raise SystemExit('refused: why')", 1),
     ("raise ValueError('bad')", 1), ("import atexit; atexit.register(print, 'at exit')", 0)],
)
def test_exit_status_and_last_words_are_a_fresh_interpreters(code, status):
    cold, warm = both(["-c", code])
    assert warm.returncode == cold.returncode == status
    assert warm.stdout == cold.stdout
    assert warm.stderr.strip().splitlines()[-1:] == cold.stderr.strip().splitlines()[-1:]


def test_a_run_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    marker = tmp_path / "grandchild"
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(600)
        """
    )
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        warm_python.run(["-c", code], timeout=5)
    assert "started" in caught.value.output
    grandchild = int(marker.read_text())
    # The whole process group got SIGKILL: the grandchild is gone (or a zombie being reaped).
    try:
        state = open(f"/proc/{grandchild}/stat").read().split(")")[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state
    assert warm_python.run(["-c", "print('next')"]).stdout == "next\n"  # the server lives on


def test_other_interpreter_options_are_refused():
    with pytest.raises(ValueError, match="takes -c CODE, -m MODULE or SCRIPT"):
        warm_python.run(["-X", "importtime", "-c", "pass"])


def test_what_is_read_at_import_is_the_childs_own_environment(tmp_path):
    # torch reads OMP_NUM_THREADS when it is imported and triton reads TRITON_INTERPRET when a
    # kernel is defined: a child with other values than the first server's gets a server of
    # its own, and sees what a fresh interpreter with that environment sees.
    script = tmp_path / "threads_and_kernel.py"  # Triton compiles only kernels from files
    script.write_text(textwrap.dedent(
        """
        import os, torch, triton
        @triton.jit
        def k(x):
            pass
        print(torch.get_num_threads(), type(k).__name__, os.environ.get("OMP_NUM_THREADS"))
        """
    ))
    for threads, interpret in (("1", "0"), ("2", "1"), ("1", "0")):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TRITON_INTERPRET": interpret}
        cold, warm = both([str(script)], env=env)
        assert cold.returncode == warm.returncode == 0, (cold.stderr[-2000:], warm.stderr[-2000:])
        assert warm.stdout == cold.stdout
        assert warm.stdout.split()[0] == threads
