"""A prefill writes into a decode's KV slots only under a lease that decode granted
(nixl-bootstrap-cascade).

A NIXL write is one-sided: the decode cannot refuse it. A prefill stopped (SIGSTOP, a hung host)
or cut off after a chunk was queued may wake and post that chunk before its control thread has
read the decode's failure of the room, while the decode, having declared it dead, freed the slots.

The lease closes that race. Each heartbeat ping carries the prefill's send time; the decode's
reply echoes it and the prefill's lease on that decode runs `lease_s` from that send time. Before
a chunk's first write (the transfer worker's update_status(Transferring)) the prefill needs a
lease with `lease_margin_s` left on every decode of the room; without one it pings at once and
waits for the reply (at most `decode_dead_s`, then the room fails), and then reads the room's
status again. The decode, for its part, frees the slots of a prefill it declared dead no sooner
than `lease_s` after the last reply it sent that prefill, and sends no reply while it fails that
prefill's rooms: any later reply reaches the prefill behind the rooms' failure notices (one
socket per peer, in order), so a prefill that renews its lease has read them first.

Left open: a write posted under a valid lease that the transport cannot finish while the prefill
is stopped (UCX over TCP moves bytes from the sender's CPU; RDMA and CUDA IPC do not) may land
after the lease; the margin bounds how late it may be posted, not how long it may take. And a
decode that dropped a prefill's endpoint (its queue stayed full; the failure notices queued there
are gone) sends that prefill no reply while it stays dropped, so its chunks to that decode fail
("no heartbeat reply") instead of being written without those notices: safe, but the pair
needs a restart.

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import _NIXL_TRANSPORT_ERRORS
from sglang.srt.utils.network import NetworkAddress

# --- prefill -------------------------------------------------------------------------------------


def _ping_decode(self, endpoint: tuple[str, int]) -> None:
    """One heartbeat ping to a decode's status socket, stamped with this rank's send time."""
    stamp = str(time.monotonic_ns()).encode("ascii")
    ping = [b"PD_PING", self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"), stamp]
    address = NetworkAddress(*endpoint)
    self._send_multipart_locked(address.to_tcp(), ping, is_ipv6=address.is_ipv6)


def _renew_decode_lease(self, endpoint: tuple[str, int], frames: list[bytes]) -> None:
    """A decode answered a ping: the lease runs from that ping's send time (never later than
    now, whatever the frame says)."""
    if len(frames) < 4:
        return  # a reply without the stamp grants nothing
    sent_s = int(bytes(frames[3]).decode("ascii")) / 1e9
    pd = self._pd_control()
    with pd.lock:
        leases = pd.decode_leases
        since = min(max(sent_s, leases.pop(endpoint, float("-inf"))), time.monotonic())
        leases[endpoint] = since
        while len(leases) > pd.bounds.peers:
            leases.popitem(last=False)


def _decode_lease_left(self, endpoint: tuple[str, int]) -> float:
    """Seconds left on this prefill's lease on a decode (negative: none)."""
    pd = self._pd_control()
    with pd.lock:
        since = pd.decode_leases.get(endpoint)
    if since is None:
        return float("-inf")
    return since + pd.bounds.lease_s - time.monotonic()


def _await_decode_lease(self, room: int) -> None:
    """The transfer worker, before a chunk of `room` writes anything: go on only with a lease
    on every decode of the room and the room still live.

    Else raise one of NIXL's transport errors: the worker then posts nothing of the chunk and
    fails the room through its own path, with this message in one WARNING line."""
    pd = self._pd_control()
    bounds = pd.bounds
    infos = self.transfer_infos.get(room) or {}
    endpoints = sorted({(i.endpoint, i.dst_port) for i in list(infos.values()) if not i.is_dummy})
    started = time.monotonic()
    pinged, pinged_at = False, float("-inf")
    while True:
        status = self.request_status.get(room)
        if status in (None, KVPoll.Failed):
            # Read after the lease: the decode's failure notice, if any, came before its reply.
            with self.failure_lock:
                reason = self.failure_records.get(room) or "its request cleared it"
            waited = time.monotonic() - started
            lease = f"; its lease ran out, {waited:.2f} s waiting for it" if pinged else ""
            self._count_control_thread_event("transfer_worker", "lease_refused_failed")
            raise _NIXL_TRANSPORT_ERRORS[-1](
                f"room {room} failed before its KV was written ({reason}){lease}; nothing written"
            )
        stale = [e for e in endpoints if self._decode_lease_left(e) < bounds.lease_margin_s]
        if not stale:
            return
        now = time.monotonic()
        if now - started >= bounds.decode_dead_s:
            names = ", ".join(f"{ip}:{port}" for ip, port in stale)
            reason = (
                f"no heartbeat reply from decode {names} within {bounds.decode_dead_s:g} s "
                f"before room {room}'s KV transfer; nothing written"
            )
            self._count_control_thread_event("transfer_worker", "lease_refused_silent")
            self._fail_live_room(room, reason)
            raise _NIXL_TRANSPORT_ERRORS[-1](reason)
        if now - pinged_at >= bounds.decode_ping_s:
            pinged, pinged_at = True, now
            for endpoint in stale:
                self._ping_decode(endpoint)
        time.sleep(0.005)


# --- decode --------------------------------------------------------------------------------------


def _answer_prefill_ping(self, frames: list[bytes]) -> None:
    """The prefill's heartbeat: reply on its control socket with its stamp, never blocking, and
    remember when (the lease it renews). Not while this decode fails a lost prefill's rooms."""
    endpoint = (bytes(frames[1]).decode("ascii"), int(frames[2]))
    address = NetworkAddress(*endpoint)
    pong = [b"PD_PONG", self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii")]
    pong += [bytes(frames[3])] if len(frames) > 3 else []
    pd = self._pd_control()
    with pd.replies_lock:
        self._send_multipart_locked(address.to_tcp(), pong, is_ipv6=address.is_ipv6)
        if len(pong) > 3:
            with pd.lock:
                pd.leases_granted.pop(endpoint, None)
                pd.leases_granted[endpoint] = time.monotonic()
                while len(pd.leases_granted) > pd.bounds.peers:
                    pd.leases_granted.popitem(last=False)


def _granted_lease_end(self, endpoints) -> float:
    """When the last lease this decode granted any of `endpoints` runs out (monotonic time)."""
    pd = self._pd_control()
    with pd.lock:
        granted = [pd.leases_granted[e] for e in endpoints if e in pd.leases_granted]
    return max(granted, default=float("-inf")) + pd.bounds.lease_s
