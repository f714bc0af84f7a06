"""The live-server harness itself: a server that cannot start fails its start at once with its
log's tail, and nothing it started outlives the fleet."""

from __future__ import annotations

import os

import pytest
from support.live import Fleet, StartFailed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_that_cannot_start_fails_with_its_log_and_leaves_nothing(tmp_path):
    missing = tmp_path / "no-such-model"
    with Fleet(tmp_path) as fleet:
        with pytest.raises(StartFailed) as failure:
            fleet.server(missing, name="broken", generate_check=False)
        proc = fleet.procs[-1]
        pid = proc.popen.pid
    assert "broken exited" in str(failure.value)
    assert str(missing) in str(failure.value)  # the log's tail names the cause
    assert proc.popen.returncode is not None and not _alive(pid)
