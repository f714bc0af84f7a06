"""Room bookkeeping and the bounded tables (nixl-bootstrap-cascade): the manager's control state
(`pd_control`, every table bounded), failing rooms on both sides, rooms' outcomes remembered,
transfer infos parked for rooms not opened yet, refused registrations.

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from types import SimpleNamespace

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.nixl.conn import TransferInfo, logger
from sglang.srt.disaggregation.utils import DisaggregationMode


def _pd_control(self) -> SimpleNamespace:
    """This manager's control state, made on first use (the scheduler's thread or a control
    thread may come first; setdefault keeps the one made first). Every table is bounded:"""
    state = self.__dict__.get("pd_control")
    if state is not None:
        return state
    bounds = SimpleNamespace(
        # rooms whose outcome is remembered (a late transfer info is answered with it), and for
        # how long; the oldest go first
        concluded_rooms=4096,
        concluded_s=600.0,
        # rooms with transfer infos from a decode before this prefill opened them, and for how
        # long they wait for their room to open before they are answered Failed
        parked_rooms=1024,
        parked_s=30.0,
        # decode peers whose registration failed, and peer endpoints dropped for not draining
        peers=4096,
        # a control loop that has not come round for this long is reported stalled
        stalled_s=10.0,
        # the prefill's heartbeat toward each decode with a live room: one ping every
        # `decode_ping_s`; a decode that answers none of `decode_pings_missed` pings over
        # `decode_dead_s` is declared dead and its live rooms fail (upstream's decode declares a
        # prefill dead after 2 missed probes 5 s apart)
        decode_ping_s=0.5,
        decode_pings_missed=4,
        decode_dead_s=5.0,
        # the lease a decode's heartbeat reply grants its prefill (lease.py): the prefill writes
        # only with `lease_margin_s` of it left; the decode frees a dead prefill's slots no
        # sooner than `lease_s` after its last reply (a few pings' worth: a busy control loop
        # makes a chunk wait for one round trip, never fail)
        lease_s=2.0,
        lease_margin_s=0.5,
        # decode: rooms whose KV slots are quarantined (held until their prefill acks the abort
        # or is declared dead) beyond which an ERROR says so; they are never freed early
        quarantined_rooms=4096,
    )
    made = SimpleNamespace(
        bounds=bounds,
        # (thread role, event) -> count, for this manager; the metric sums all managers
        events={},
        # thread role -> SimpleNamespace, see _control_thread_state
        threads={},
        # (thread role, message kind) -> (last logged, left out since): rate-limits drop lines;
        # bounded by the roles and kinds _describe_nixl_control_message names
        drop_log={},
        lock=threading.RLock(),  # the room and peer tables below
        concluded=OrderedDict(),  # room -> SimpleNamespace(reason, opened, at)
        parked=OrderedDict(),  # room -> SimpleNamespace(at, infos: agent name -> TransferInfo)
        failed_registrations=OrderedDict(),  # decode agent name -> cause
        dropped_endpoints=OrderedDict(),  # tcp://ip:port -> cause
        # prefill: (ip, port) of each decode with a live room -> SimpleNamespace(unanswered,
        # silent_since); at most one per live room
        decode_links={},
        probed_at=0.0,
        # prefill: (ip, port) of a decode -> send time of its latest answered ping (the lease);
        # decode: (ip, port) of a prefill rank -> when this decode last answered its ping, and
        # the lock that keeps replies out while a lost prefill's rooms fail. At most `peers`.
        decode_leases=OrderedDict(),
        leases_granted=OrderedDict(),
        replies_lock=threading.RLock(),
        # decode: the thread applying a prefill's status (a failure it reports is not echoed),
        # and the prefill endpoints of rooms failing because that prefill was lost
        applying_prefill_status=None,
        lost_prefill_endpoints={},
        # decode: failed room -> SimpleNamespace(slots, acks_owed, prefill, since, prefill_dead,
        # lease_end), its KV slots out of the free list; rooms of prefills declared dead ->
        # SimpleNamespace(at, lease_end) (bounded like `concluded`), for rooms quarantined after
        # the death
        quarantine={},
        quarantine_over_bound=False,
        dead_prefill_rooms=OrderedDict(),
        metric_failed=False,
    )
    state = self.__dict__.setdefault("pd_control", made)
    self.__dict__.setdefault("control_thread_events", state.events)
    return state


def control_table_sizes(self) -> dict:
    """Entries in each per-room and per-peer table this manager keeps (for /server_info)."""
    pd = self._pd_control()
    sizes = {
        "concluded_rooms": len(pd.concluded),
        "parked_rooms": len(pd.parked),
        "failed_registrations": len(pd.failed_registrations),
        "dropped_endpoints": len(pd.dropped_endpoints),
        "request_status": len(self._room_status_snapshot()),
    }
    if self.disaggregation_mode == DisaggregationMode.PREFILL:
        sizes["transfer_infos"] = len(self.transfer_infos)
        sizes["req_to_decode_prefix_len"] = len(self.req_to_decode_prefix_len)
    else:
        with pd.lock:
            quarantined = list(pd.quarantine.values())
            sizes["dead_prefill_rooms"] = len(pd.dead_prefill_rooms)
        sizes["quarantined_rooms"] = len(quarantined)
        sizes["quarantined_slots"] = sum(entry.slots for entry in quarantined)
    return sizes


def _fail_live_room(self, room: int, reason: str) -> bool:
    """Fail a room that is neither finished nor failed; False when there is no such room."""
    status = self.request_status.get(room)
    if status is None or status in (KVPoll.Success, KVPoll.Failed):
        return False
    if self.disaggregation_mode == DisaggregationMode.PREFILL:
        # Also tells the decode ranks this room reached, so they stop waiting too.
        try:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return True
        except Exception:
            logger.exception("Could not tell decode that room %s failed; failing it here", room)
    self.record_failure(room, reason)
    self.update_status(room, KVPoll.Failed)
    return True


def _refuse_room(self, room: int, reason: str, decode: tuple[str, int] | None = None) -> bool:
    """Fail a room a decode asked for, on both sides, even before the prefill opens it.

    Returns whether a live room failed here. `decode` is the status endpoint of the decode
    whose message is refused; it is told even when the prefill has not stored its info.
    """
    failed_here = self._fail_live_room(room, reason)
    if room not in self.request_status:
        self._remember_concluded_room(room, reason, opened=False)
    if decode is not None:
        self.send_kv_status_message(
            targets=[decode], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
        )
    return failed_here


def _remember_concluded_room(self, room: int, reason: str | None, opened: bool) -> None:
    """Keep how a room ended for a while (`reason` None: it succeeded), so that a late transfer
    info for it is answered Failed instead of bringing it back (`opened`), or the room fails as
    soon as the prefill opens it (not `opened`: a decode's message for it was refused)."""
    pd = self._pd_control()
    now = time.monotonic()
    with pd.lock:
        pd.concluded.pop(room, None)
        pd.concluded[room] = SimpleNamespace(reason=reason, opened=opened, at=now)
        # Bounded: the oldest go first, and none is kept past its time.
        while pd.concluded and (
            len(pd.concluded) > pd.bounds.concluded_rooms
            or now - next(iter(pd.concluded.values())).at > pd.bounds.concluded_s
        ):
            pd.concluded.popitem(last=False)


def _recall_concluded_room(self, room: int, forget: bool = False) -> SimpleNamespace | None:
    pd = self._pd_control()
    with pd.lock:
        return pd.concluded.pop(room, None) if forget else pd.concluded.get(room)


def update_status(self, bootstrap_room: int, status: KVPoll):
    """The common status update; on a prefill, a room that fails also tells its decode ranks,
    a room that opens takes the transfer infos that came before it, and a room that ends is
    remembered so a late transfer info cannot bring it back.

    Every failure path (sender abort, bootstrap timeout, control-thread death, a refused
    message) ends here, so decode learns at once instead of at its waiting timeout. A prefill
    room turning Transferring (the transfer worker, before a chunk's first write) first waits
    for its decodes' lease (lease.py).
    """
    if self.disaggregation_mode != DisaggregationMode.PREFILL:
        before = self.request_status.get(bootstrap_room)
        CommonKVManager.update_status(self, bootstrap_room, status)
        if status == KVPoll.Failed and before not in (None, KVPoll.Failed):
            self._tell_prefill_room_failed(bootstrap_room)
        return
    if status == KVPoll.Transferring and bootstrap_room in self.request_status:
        # The transfer worker, before a chunk's first write: only under the decode's lease.
        self._await_decode_lease(bootstrap_room)
    before = self.request_status.get(bootstrap_room)
    CommonKVManager.update_status(self, bootstrap_room, status)
    if before is None:
        if bootstrap_room in self.request_status:
            self._on_room_opened(bootstrap_room)
    elif status == KVPoll.Failed and before != KVPoll.Failed:
        self._on_room_failed(bootstrap_room)
    elif status == KVPoll.Success and before not in (KVPoll.Success, KVPoll.Failed):
        if self.request_status.get(bootstrap_room) == KVPoll.Success:
            self._remember_concluded_room(bootstrap_room, None, opened=True)


def _on_room_opened(self, room: int) -> None:
    remembered = self._recall_concluded_room(room, forget=True)
    if remembered is not None and not remembered.opened:
        # A decode's message for this room was refused before the prefill opened it.
        self.record_failure(room, remembered.reason)
        self.update_status(room, KVPoll.Failed)
        return
    # Else a new request (perhaps reusing the number of a room that ended) starts clean, with
    # the transfer infos its decode sent before the prefill opened it.
    pd = self._pd_control()
    with pd.lock:
        parked = pd.parked.pop(room, None)
        if parked is not None:
            for info in parked.infos.values():
                self._store_transfer_info(info)


def _on_room_failed(self, room: int) -> None:
    """Tell the room's decode ranks it failed, with the reason; never raises."""
    try:
        with self.failure_lock:
            reason = self.failure_records.get(room)
        self._remember_concluded_room(
            room, reason or self.DEFAULT_PREFILL_FAILURE_REASON, opened=True
        )
        if getattr(self, "_decode_abort_thread", None) == threading.get_ident():
            return  # the decode asked for it (ABORT) and keeps its own reason
        self.send_kv_status_message(
            targets=self._room_notify_targets(room),
            bootstrap_room=room,
            status=KVPoll.Failed,
            failure_reason=reason,
        )
    except Exception:
        logger.exception("Could not tell decode that room %s failed", room)


def _record_failed_registration(self, peer: str, error: Exception) -> None:
    """Remember why a decode peer could not register; its rooms fail until it registers."""
    cause = f"{type(error).__name__}: {str(error)[:300]}"
    pd = self._pd_control()
    with pd.lock:
        known = pd.failed_registrations.get(peer)
        pd.failed_registrations[peer] = cause
        while len(pd.failed_registrations) > pd.bounds.peers:
            pd.failed_registrations.popitem(last=False)
    if known != cause:
        logger.error(
            "Decode peer %s could not register with prefill engine_rank=%s (%s); every room "
            "it sends fails at once until it registers successfully",
            peer,
            self.kv_args.engine_rank,
            cause,
        )


def _transfer_info_refusal(self, info: TransferInfo) -> str | None:
    """Why this transfer info must not be stored, or None."""
    pd = self._pd_control()
    cause = pd.failed_registrations.get(info.agent_name)
    if cause is not None:
        return (
            f"decode peer {info.agent_name} failed to register with prefill "
            f"engine_rank={self.kv_args.engine_rank}: {cause}"
        )
    status = self.request_status.get(info.room)
    if status == KVPoll.Failed:
        with self.failure_lock:
            reason = self.failure_records.get(info.room)
        return reason or self.DEFAULT_PREFILL_FAILURE_REASON
    if status is None:
        remembered = self._recall_concluded_room(info.room)
        if remembered is not None:
            return remembered.reason or (
                f"room {info.room} already finished on prefill "
                f"engine_rank={self.kv_args.engine_rank}; its transfer info came too late"
            )
    return None


def _park_transfer_info(self, info: TransferInfo) -> None:
    """Hold a transfer info for a room this prefill has not opened yet (a decode may send it
    first). Bounded: beyond `parked_rooms` rooms the oldest room is answered Failed."""
    pd = self._pd_control()
    with pd.lock:
        parked = pd.parked.get(info.room)
        if parked is None:
            parked = pd.parked[info.room] = SimpleNamespace(at=time.monotonic(), infos={})
        parked.infos[info.agent_name] = info
        evicted = []
        while len(pd.parked) > pd.bounds.parked_rooms:
            evicted.append(pd.parked.popitem(last=False))
    for room, entry in evicted:
        self._answer_parked_room(
            room,
            entry,
            f"no request opened room {room} on prefill engine_rank={self.kv_args.engine_rank} "
            f"before {pd.bounds.parked_rooms} later rooms' transfer infos came",
        )


def _expire_parked_transfer_infos(self) -> int:
    """Answer Failed the parked rooms that did not open within `parked_s`; how many."""
    pd = self._pd_control()
    if not pd.parked:
        return 0
    now = time.monotonic()
    expired = []
    with pd.lock:
        while pd.parked and now - next(iter(pd.parked.values())).at > pd.bounds.parked_s:
            expired.append(pd.parked.popitem(last=False))
    for room, entry in expired:
        self._answer_parked_room(
            room,
            entry,
            f"no request opened room {room} on prefill engine_rank={self.kv_args.engine_rank} "
            f"within {pd.bounds.parked_s:g} s of its transfer info",
        )
    return len(expired)


def _answer_parked_room(self, room: int, entry: SimpleNamespace, reason: str) -> None:
    endpoints = {(info.endpoint, info.dst_port) for info in entry.infos.values()}
    self._remember_concluded_room(room, reason, opened=False)
    for endpoint in endpoints:
        self.send_kv_status_message(
            targets=[endpoint], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
        )


def _room_status_snapshot(self) -> list[tuple[int, int]]:
    statuses = self.request_status
    if not isinstance(statuses, dict):
        # PP prefill: a PPConsensusStore, whose local map holds this rank's statuses.
        statuses = statuses._local_map
    return list(statuses.items())


def _fail_rooms_awaiting_bootstrap(self, reason: str) -> int:
    waiting = [
        room for room, status in self._room_status_snapshot() if status == KVPoll.Bootstrapping
    ]
    return sum(self._fail_live_room(room, reason) for room in waiting)


def _fail_rooms_awaiting_prefill(self, reason: str) -> int:
    return sum(self._fail_live_room(room, reason) for room, _ in self._room_status_snapshot())
