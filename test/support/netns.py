"""Two hosts on one machine: two network namespaces joined by a veth pair, for PD fault tests.

    with TwoHosts() as hosts:
        hosts.a, hosts.b                      # the two addresses (10.237.N.1 and .2, /30)
        hosts.popen("a", [sys.executable, ...])  # a process on host a (ip netns exec)
        hosts.cut(); hosts.restore()          # ip link set down / up on both ends of the link

Only the namespaces made here are touched, and only their own addresses are ever targets. Every
process started through `popen` runs in its own process group; `close` (or leaving the `with`)
kills each group with SIGKILL (after a SIGCONT, for a stopped one) and deletes both namespaces,
which removes the veth pair with them. Needs root and `ip netns` (iproute2); `available()` says
why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from itertools import count

_serial = count()


def _subnet(n: int) -> int:
    """A /30's third octet: the test worker's own half of 1-250 (pytest-xdist's gw0, gw1 run at
    once), then this process's pid and serial."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    half = int(worker) % 2 if worker.isdigit() else 0
    return half * 125 + (os.getpid() + n) % 125 + 1


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=check, timeout=10
    )


def available() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    def __init__(self):
        n = next(_serial)
        tag = f"{os.getpid() % 100000}x{n}"
        self.names = {"a": f"pda{tag}", "b": f"pdb{tag}"}
        self.links = {"a": f"vpa{tag}", "b": f"vpb{tag}"}
        subnet = _subnet(n)
        self.a, self.b = f"10.237.{subnet}.1", f"10.237.{subnet}.2"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            for side in ("a", "b"):
                _ip("netns", "add", self.names[side])
                self._made.append(self.names[side])
            _ip("link", "add", self.links["a"], "type", "veth", "peer", "name", self.links["b"])
            for side, address in (("a", self.a), ("b", self.b)):
                _ip("link", "set", self.links[side], "netns", self.names[side])
                ns = self.names[side]
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", self.links[side])
                _ip("-n", ns, "link", "set", self.links[side], "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on host `side`, in its own process group."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[side], *argv], start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def _set_link(self, state: str) -> None:
        for side in ("a", "b"):
            _ip("-n", self.names[side], "link", "set", self.links[side], state)

    def cut(self) -> None:
        """The link goes down on both ends: packets are lost, no connection is reset."""
        self._set_link("down")

    def restore(self) -> None:
        self._set_link("up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        _ip("link", "del", self.links["a"], check=False)  # if it never left this namespace
        while self._made:  # deleting a namespace removes the veth end inside it
            _ip("netns", "del", self._made.pop(), check=False)

    def exists(self) -> bool:
        listed = _ip("netns", "list", check=False).stdout
        return any(name in listed for name in self.names.values())


class GuestHost:
    """A second host joined to this one: one network namespace whose only way out is a veth pair
    to this host's namespace (its default route), so a process in it reaches every address of
    this host and this host reaches it at `address`.

        with GuestHost() as guest:
            guest.command([sys.executable, ...])  # argv that runs on the guest (ip netns exec)
            guest.cut(); guest.restore()          # this host's end of the link down / up

    `cut` takes down this host's end only: packets are lost, no connection is reset, and the
    guest keeps its routes, so `restore` brings everything back. Processes are the caller's to
    stop; `close` deletes the namespace (and the veth pair with it).
    """

    def __init__(self):
        n = next(_serial)
        tag = f"{os.getpid() % 100000}x{n}"
        self.name, self.link, self.peer = f"pdg{tag}", f"vpg{tag}", f"vph{tag}"
        subnet = _subnet(n)
        self.gateway, self.address = f"10.238.{subnet}.1", f"10.238.{subnet}.2"
        self._made = False
        try:
            _ip("netns", "add", self.name)
            self._made = True
            _ip("link", "add", self.link, "type", "veth", "peer", "name", self.peer)
            _ip("link", "set", self.peer, "netns", self.name)
            _ip("addr", "add", f"{self.gateway}/30", "dev", self.link)
            _ip("link", "set", self.link, "up")
            _ip("-n", self.name, "addr", "add", f"{self.address}/30", "dev", self.peer)
            _ip("-n", self.name, "link", "set", self.peer, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
            _ip("-n", self.name, "route", "add", "default", "via", self.gateway)
        except Exception:
            self.close()
            raise

    def __enter__(self) -> GuestHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def close(self) -> None:
        _ip("link", "del", self.link, check=False)
        if self._made:
            _ip("netns", "del", self.name, check=False)
            self._made = False

    def exists(self) -> bool:
        return self.name in _ip("netns", "list", check=False).stdout
