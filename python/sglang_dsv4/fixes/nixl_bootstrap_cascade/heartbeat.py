"""Heartbeat both ways and a failed room told to the other side (nixl-bootstrap-cascade): the
decode's handling of a lost prefill, the prefill's pings to its decodes, a decode's failure of a
room sent to the room's prefill ranks.

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
from sglang.srt.disaggregation.nixl.conn import logger
from sglang.srt.utils.network import NetworkAddress


def _handle_node_failure(self, failed_bootstrap_addr: str):
    """Run the common failure handling without letting it end the heartbeat thread.

    The heartbeat checker guards only its HTTP probe. If the handling raises (a room
    cleared between its `in` check and check_status, a malformed cached endpoint),
    fail the rooms tracked for that prefill here instead.
    """
    # No heartbeat reply leaves for any prefill while this one's rooms fail (lease.py): a
    # reply sent later reaches it behind the rooms' failure notices.
    with self._pd_control().replies_lock:
        self._fail_lost_prefill(failed_bootstrap_addr)


def _fail_lost_prefill(self, failed_bootstrap_addr: str) -> None:
    """The decode's heartbeat declared a prefill dead: its rooms fail, told to it."""
    with self.connection_lock:
        rooms = list(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, ()))
    # The common handling forgets the prefill's endpoints before it fails the rooms: keep them,
    # so each room's failure is still sent to the prefill (a hung or cut-off prefill that comes
    # back reads it before it could write into slots this decode has given up).
    pd = self._pd_control()
    endpoints = self._prefill_endpoints_of_address(failed_bootstrap_addr)
    # Nothing of a dead prefill writes once its lease is out: its rooms' KV slots leave the
    # quarantine then.
    self._note_prefill_dead(failed_bootstrap_addr, rooms, endpoints)
    pd.lost_prefill_endpoints = {room: endpoints for room in rooms}
    for ip, port in endpoints:
        # As the prefill does for a lost decode: the rooms' failure goes on a fresh connection.
        self._close_peer_socket(NetworkAddress(ip, port).to_tcp())
    try:
        CommonKVManager._handle_node_failure(self, failed_bootstrap_addr)
    except Exception as e:
        self._count_control_thread_event("decode_heartbeat", "error")
        reason = f"Lost connection with prefill instance (bootstrap_addr: {failed_bootstrap_addr})"
        # Forget the prefill as the common handling would, so it is not probed and failed again,
        # and drop its cached rank endpoints: a restarted prefill gets fresh ones and this
        # decode's registration again. Then fail its rooms.
        with self.connection_lock:
            self.prefill_info_table.pop(failed_bootstrap_addr, None)
            self.addr_to_rooms_tracker.pop(failed_bootstrap_addr, None)
            self.heartbeat_failures.pop(failed_bootstrap_addr, None)
            stale = [k for k in self.connection_pool if k.startswith(f"{failed_bootstrap_addr}_")]
            cached = [info for k in stale for info in self.connection_pool.pop(k)]
        for info in cached:
            try:
                address = NetworkAddress(info["rank_ip"], int(info["rank_port"]))
                CommonKVReceiver.disconnect_endpoint(address.to_tcp())
            except Exception:
                pass  # an endpoint that does not parse was never connected
        failed = sum(self._fail_live_room(room, reason) for room in rooms)
        logger.error(
            "Handling the loss of prefill %s raised %s: %s; failed its %d live room(s) "
            "directly, the heartbeat thread goes on",
            failed_bootstrap_addr,
            type(e).__name__,
            e,
            failed,
            exc_info=True,
        )
    finally:
        pd.lost_prefill_endpoints = {}


def _probe_decode_peers(self) -> None:
    """The prefill's heartbeat toward its decodes, run by the bootstrap loop (never blocks).

    Every decode endpoint named by a live room's transfer info is pinged each `decode_ping_s`
    on its status socket; its listener answers on this rank's control socket. A decode that
    answers none of `decode_pings_missed` pings sent over `decode_dead_s` (killed, hung, or cut
    off) is declared dead: its live rooms fail with the reason, as a decode fails the rooms of a
    prefill it lost. Silence is measured from the first unanswered ping, so a prefill that was
    itself stopped does not declare its decodes dead on waking.
    """
    pd = self._pd_control()
    bounds = pd.bounds
    now = time.monotonic()
    if now - pd.probed_at < bounds.decode_ping_s:
        return
    pd.probed_at = now
    rooms_of: dict = {}
    for room, infos in list(self.transfer_infos.items()):
        if self.request_status.get(room) in (None, KVPoll.Success, KVPoll.Failed):
            continue
        for info in list(infos.values()):
            if not info.is_dummy:
                rooms_of.setdefault((info.endpoint, info.dst_port), []).append(room)
    links = pd.decode_links
    for endpoint in [e for e in links if e not in rooms_of]:
        del links[endpoint]  # no live room left: nothing to watch
    for endpoint, rooms in rooms_of.items():
        link = links.get(endpoint)
        if link is None:
            link = links[endpoint] = SimpleNamespace(unanswered=0, silent_since=now)
        if (
            link.unanswered >= bounds.decode_pings_missed
            and now - link.silent_since >= bounds.decode_dead_s
        ):
            del links[endpoint]
            self._on_decode_lost(endpoint, rooms, now - link.silent_since)
            continue
        if link.unanswered == 0:
            link.silent_since = now
        link.unanswered += 1
        self._ping_decode(endpoint)


def _on_decode_pong(self, frames: list[bytes]) -> None:
    endpoint = (bytes(frames[1]).decode("ascii"), int(frames[2]))
    link = self._pd_control().decode_links.get(endpoint)
    if link is not None:
        link.unanswered = 0
    self._renew_decode_lease(endpoint, frames)


def _on_decode_lost(self, endpoint: tuple[str, int], rooms: list[int], silent_s: float) -> None:
    reason = (
        f"Lost connection with decode instance (endpoint: {endpoint[0]}:{endpoint[1]}; no "
        f"heartbeat reply for {silent_s:.1f} s)"
    )
    # A fresh connection first: the old one may be stalled in retransmission for many seconds
    # after the link is back; the failure below (and all that follows) goes on the new one.
    self._close_peer_socket(NetworkAddress(*endpoint).to_tcp())
    failed = sum(self._fail_live_room(room, reason) for room in rooms)
    self._count_control_thread_event("prefill_bootstrap", "decode_lost")
    logger.error("%s, %d requests affected", reason, failed)


def _on_decode_room_failed(self, frames: list[bytes]) -> None:
    """A decode failed a room first (its own timeout, a lost prefill, an abort): fail it here
    too, with the decode's reason, before any transfer into its slots starts or completes."""
    room = int(bytes(frames[1]).decode("ascii"))
    reason = bytes(frames[2]).decode("utf-8", "replace") if len(frames) > 2 else ""
    status = self.request_status.get(room)
    if status is None or status in (KVPoll.Success, KVPoll.Failed):
        return
    self.record_failure(room, f"Decode failed the room: {reason or 'no reason given'}")
    self._decode_abort_thread = threading.get_ident()  # the decode knows: not told back
    try:
        self.update_status(room, KVPoll.Failed)
    finally:
        self._decode_abort_thread = None


def _prefill_endpoints_of_address(self, bootstrap_addr: str) -> list[tuple[str, int]]:
    """(rank ip, rank port) of every prefill rank this decode knows behind a bootstrap addr."""
    with self.connection_lock:
        infos = [
            info
            for key, cached in self.connection_pool.items()
            if key.startswith(f"{bootstrap_addr}_")
            for info in cached
        ]
    endpoints = set()
    for info in infos:
        try:
            endpoints.add((info["rank_ip"], int(info["rank_port"])))
        except (KeyError, TypeError, ValueError):
            pass  # an endpoint that does not parse was never connected
    return sorted(endpoints)


def _tell_prefill_room_failed(self, room: int) -> None:
    """Decode: a room failed here first; tell its prefill ranks, with the reason. Never raises,
    never blocks (a lost prefill reads it when it comes back)."""
    pd = self._pd_control()
    if pd.applying_prefill_status == threading.get_ident():
        return  # the prefill reported it
    try:
        endpoints = pd.lost_prefill_endpoints.get(room)
        if endpoints is None:
            with self.connection_lock:
                addresses = [a for a, rooms in self.addr_to_rooms_tracker.items() if room in rooms]
            endpoints = [e for a in addresses for e in self._prefill_endpoints_of_address(a)]
        if not endpoints:
            return
        with self.failure_lock:
            reason = self.failure_records.get(room) or "the decode failed the room"
        message = [b"PD_ROOM_FAILED", str(room).encode("ascii"), reason.encode("utf-8")]
        for ip, port in endpoints:
            address = NetworkAddress(ip, port)
            self._send_multipart_locked(address.to_tcp(), message, is_ipv6=address.is_ipv6)
    except Exception:
        logger.exception("Could not tell prefill that room %s failed on this decode", room)
