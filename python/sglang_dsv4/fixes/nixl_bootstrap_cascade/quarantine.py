"""The KV slots of a room a decode failed stay out of the free list until nothing can write them
(nixl-bootstrap-cascade).

Upstream's decode already holds a failed room's slots (deferred KV release) while it waits for
each prefill rank's ABORT_ACK, but frees them anyway when
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s) passes: a prefill that is hung,
cut off, or that could not prove its writes drained (a poisoned room) may then write into slots
that already belong to another request. Here a NIXL decode quarantines them instead: held, with no
deadline, until every prefill rank owed an ack has sent it, or the prefill is declared dead by the
decode's heartbeat. Counted (events and a gauge of quarantined slots) and in /server_info.

`_defer_release` is written as it stands in sglang/srt/disaggregation/decode.py, the rest as they
stand in sglang/srt/disaggregation/nixl/conn.py (the fix replaces and adds them there).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, logger

if TYPE_CHECKING:
    from sglang.srt.disaggregation.decode import DecodeRequest

# --- sglang/srt/disaggregation/decode.py -------------------------------------------------------


def _defer_release(self, decode_req: DecodeRequest) -> None:
    """Hold a failed request's KV slots and metadata slot until the room is safe to release.

    A manager that keeps a quarantine (`quarantine_room`: NIXL) holds a device destination with no
    deadline: its manager's is_abort_release_safe says when (every prefill rank acked, or the
    prefill was declared dead). Host destinations, and managers without one, keep the timeout.
    """
    receiver = decode_req.kv_receiver
    held_at = time.monotonic()
    on_host = self._is_host_destination(decode_req)
    # Only a rank that sent the ABORT itself waits for acks; one holding for a peer waits for none.
    acks_owed = len(receiver.bootstrap_infos) if receiver.abort_notified and not on_host else 0
    quarantine = None if on_host else getattr(receiver.kv_mgr, "quarantine_room", None)
    if quarantine is None:
        release_by = held_at + self.deferred_kv_release_timeout
    else:
        release_by = float("inf")
        quarantine(
            decode_req.req.bootstrap_room,
            decode_req.req.kv.kv_allocated_len,
            acks_owed,
            receiver.bootstrap_addr,
        )
    self._deferred_releases.append(
        (decode_req, held_at, release_by, decode_req.metadata_buffer_index, acks_owed)
    )


# --- sglang/srt/disaggregation/nixl/conn.py ----------------------------------------------------


def quarantine_room(self, room: int, slots: int, acks_owed: int, bootstrap_addr: str) -> None:
    """Decode: a failed room's KV slots are held until the prefill acks or is declared dead.
    Never raises (the scheduler calls it)."""
    try:
        pd = self._pd_control()
        with pd.lock:
            dead = pd.dead_prefill_rooms.pop(room, None)
            pd.quarantine[room] = SimpleNamespace(
                slots=int(slots),
                acks_owed=acks_owed,
                prefill=bootstrap_addr,
                since=time.monotonic(),
                prefill_dead=dead is not None,
                lease_end=float("inf") if dead is None else dead.lease_end,
            )
            rooms = len(pd.quarantine)
            over = rooms > pd.bounds.quarantined_rooms and not pd.quarantine_over_bound
            if over:
                pd.quarantine_over_bound = True
        self._count_control_thread_event("decode_quarantine", "held")
        self._publish_quarantined_slots()
        if over:
            self._count_control_thread_event("decode_quarantine", "over_bound")
            logger.error(
                "NIXL decode engine_rank=%s holds the KV slots of %d failed rooms (bound %d): "
                "they are freed only when their prefill acks the abort or is declared dead; "
                "is a prefill hung without its heartbeat failing?",
                self.kv_args.engine_rank,
                rooms,
                pd.bounds.quarantined_rooms,
            )
    except Exception:
        logger.exception("Could not quarantine the KV slots of failed room %s", room)


def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
    """Every prefill rank owed an ack has sent it, or the room's prefill was declared dead."""
    if CommonKVManager.is_abort_release_safe(self, bootstrap_room, required_acks):
        freed_by = "ack"
    else:
        entry = self._pd_control().quarantine.get(bootstrap_room)
        if entry is None or not entry.prefill_dead or time.monotonic() < entry.lease_end:
            return False  # a dead prefill may still write until the lease it was granted ends
        freed_by = "prefill_dead"
    entry = self._pd_control().quarantine.get(bootstrap_room)
    if entry is not None:
        entry.freed_by = freed_by
    return True


def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
    """The room's slots were released: it leaves the quarantine (counted by why)."""
    CommonKVManager.clear_deferred_abort_state(self, bootstrap_room)
    pd = self._pd_control()
    with pd.lock:
        entry = pd.quarantine.pop(bootstrap_room, None)
        if len(pd.quarantine) <= pd.bounds.quarantined_rooms:
            pd.quarantine_over_bound = False
    if entry is None:
        return
    freed_by = getattr(entry, "freed_by", "ack")
    self._count_control_thread_event("decode_quarantine", f"released_{freed_by}")
    self._publish_quarantined_slots()
    if freed_by != "ack":
        logger.info(
            "KV slots of failed room %s (%d) released: prefill %s was declared dead after %.1f s",
            bootstrap_room,
            entry.slots,
            entry.prefill,
            time.monotonic() - entry.since,
        )


def _note_prefill_dead(self, bootstrap_addr: str, rooms, endpoints) -> None:
    """The decode's heartbeat declared the prefill at `bootstrap_addr` dead: nothing of it
    writes once the lease this decode last granted its ranks (`endpoints`) ends, for the slots
    of its rooms quarantined now (by that prefill) or later (`rooms`, its live rooms, which fail
    now). Bounded (the oldest go first)."""
    pd = self._pd_control()
    now = time.monotonic()
    lease_end = self._granted_lease_end(endpoints)
    with pd.lock:
        for entry in pd.quarantine.values():
            if entry.prefill == bootstrap_addr:
                entry.prefill_dead = True
                entry.lease_end = lease_end
        for room in rooms:
            if room not in pd.quarantine:
                pd.dead_prefill_rooms.pop(room, None)
                pd.dead_prefill_rooms[room] = SimpleNamespace(at=now, lease_end=lease_end)
        while pd.dead_prefill_rooms and (
            len(pd.dead_prefill_rooms) > pd.bounds.concluded_rooms
            or now - next(iter(pd.dead_prefill_rooms.values())).at > pd.bounds.concluded_s
        ):
            pd.dead_prefill_rooms.popitem(last=False)


def _quarantined_slots_gauge(self):
    # One gauge per process, shared by every manager in it.
    gauge = NixlKVManager.__dict__.get("_quarantined_slots_total")
    if gauge is None:
        from prometheus_client import Gauge

        gauge = Gauge(
            "sglang:nixl_kv_quarantined_slots",
            "KV slots of rooms this decode failed, held out of the free list until their "
            "prefill acks the abort or is declared dead.",
            multiprocess_mode="livesum",
        )
        NixlKVManager._quarantined_slots_total = gauge
    return gauge


def _publish_quarantined_slots(self) -> None:
    """Set the gauge to this manager's quarantined slots; never raises (failure paths call it)."""
    pd = self._pd_control()
    with pd.lock:
        slots = sum(entry.slots for entry in pd.quarantine.values())
    try:
        self._quarantined_slots_gauge().set(slots)
    except Exception as e:
        if not pd.metric_failed:
            pd.metric_failed = True
            logger.error("NIXL quarantine metric not updated (%s: %s)", type(e).__name__, e)
