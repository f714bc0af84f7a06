"""nixl-bootstrap-cascade: the NIXL connector's control threads survive bad messages and deaths.

Register entry
  Target:      sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_decode_listener_thread
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._handle_node_failure (added)
               sglang.srt.disaggregation.nixl.conn.NixlKVManager.update_status (added)
               sglang.srt.managers.scheduler_components.internal_state
                 .SchedulerInternalStateController._add_disaggregation
               sglang.srt.entrypoints.http_server.health_generate (its routes /health and
                 /health_generate, taken by health_with_nixl_control_threads, added)
  Why:         One thread on each prefill rank receives everything decode ranks send (peer
               registrations, transfer info, ABORT, staging replies). In 0.5.23 any exception ends
               it: a foreign message fails the guard assert, a truncated or undecodable one raises
               while parsed, and the guarded wrapper only logs and re-raises. From then on no request
               to that rank leaves KVPoll.Bootstrapping until the bootstrap timeout (300 s), and
               decode aborts request after request: the cascade that wedged production. Decode's
               listener has the same shape (a STAGING_REQ that fails to parse ends it; rooms then
               wait out the waiting timeout), and decode's heartbeat checker calls
               _handle_node_failure outside its guard (a room cleared by the scheduler between
               `in` and check_status raises KeyError there), which ends failure detection for good.
  How:         Both control threads run one supervised loop: each message is handled in its own
               try; a bad one is dropped with a log line rate-limited per (thread, kind) that names
               kind, peer and room when the frames tell them; a live room the message names is
               failed with the reason (prefill: conclude_failure, which also tells the decode ranks
               the room reached; Failed stays terminal); ABORT for an unknown or finished room stays
               a no-op. A registration that fails half-way is rolled back so the peer can register
               again. If the loop dies anyway (socket error, a bug), the rooms waiting on it fail at
               once (prefill: every Bootstrapping room; decode: every room not yet Success/Failed)
               and the loop restarts after 0.1 s, doubling to at most 10 s while it keeps dying. A
               terminated ZMQ context or closed socket ends it cleanly. Dropped messages, deaths and
               isolated heartbeat errors are counted per manager (`control_thread_events`) and in
               the Prometheus counter sglang:nixl_control_thread_events_total{thread,event}. The
               threads are daemons, like the connector's other threads.
               Both sides hear every failure: on a prefill, update_status tells the room's decode
               ranks (KV_STATUS Failed with the recorded reason) whenever a room turns Failed,
               except on the decode's own ABORT; why each room failed is kept (at most 4,096 rooms,
               10 minutes) so a transfer info for a failed or already cleared room is answered
               Failed instead of stored, and a room refused before the prefill opened it fails
               when it opens. A malformed transfer info is answered to the endpoint it names. A
               refused registration is recorded per peer and logged at ERROR once per cause; each
               transfer info from that peer then fails its room at once, until the peer registers.
               The metric is written in a try (logged once); the death path cannot raise. Two
               socket errors with nothing received between close the socket and bind a new one on
               the same port. The heartbeat fallback drops and disconnects the lost prefill's
               cached endpoints. control_thread_health() reports each thread's liveness, deaths,
               last death, why it stopped, and `down`: stopped, or restarting in vain (3 deaths
               in a row with no message served between them, the last within 30 s).
               /health: upstream's probe answers 200 once any scheduler output arrives, over a
               fake bootstrap that bypasses NIXL, so it cannot see these threads. The scheduler's
               state readback (_add_disaggregation) now carries `nixl_control_threads`, the
               health of every TP rank's threads (gathered over the TP group, which every rank
               handles the request on; with DP attention each DP leader reports itself), and
               /server_info shows it. /health and /health_generate of a PD server read it first
               (get_internal_state, 5 s bound; no answer leaves it to upstream's probe) and
               answer 503 with one line naming thread, engine rank, why and the last death
               while a thread is down, mark the server UnHealthy (so /ready fails too, as for a
               failed probe) and log it at ERROR once; when the threads serve again it logs so
               and marks the server Up. Otherwise upstream's health_generate runs unchanged.
               FastAPI keeps the function a route was declared with, so the new endpoint takes
               the routes over (register.Routes: the hook re-points them, the patch moves the
               decorators). Not covered: with --tokenizer-worker-num > 1, uvicorn's workers
               import the app without loading plugins (the patched delivery covers them).
               Audit of the other long-lived NIXL connector threads: transfer_worker (prefill)
               already catches every exception per chunk and fails the room, no change;
               decode_listener_thread (decode) had no guard at all, fixed as above; the heartbeat
               checker (decode, CommonKVManager) guards its HTTP probe only, so
               NixlKVManager._handle_node_failure now isolates the failure handling and, if it
               raises, fails the rooms tracked for that prefill itself; CommonKVBootstrapServer
               (aiohttp, per-request isolation) and the prefill-recompute thread pool (per-task
               futures) do not have the pattern.
  Upstream:    Not upstream. PR #30352 (sgl-project/sglang) made the thread handle ABORT instead
               of dying on it; PR #34692 added the prefill bootstrap timeout that bounds the wedge
               at 300 s; PR #35281 set out to keep Mooncake/NIXL control loops serving after
               malformed messages, but its loop-wrapping handlers were dropped in review. 0.5.23
               logs the thread's death and keeps every room waiting until that timeout.
  Remove when: upstream's NIXL control threads isolate each message, fail waiting rooms when a
               thread dies, and restart it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time
from collections import OrderedDict

import zmq
from fastapi import Request
from fastapi.responses import Response
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
from sglang.srt.disaggregation.common.staging_handler import (
    handle_staging_rsp,
    handle_watermark_msg,
)
from sglang.srt.disaggregation.nixl.conn import (
    ABORT_TAG,
    GUARD,
    KVArgsRegisterInfo,
    NixlKVManager,
    TransferInfo,
    logger,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints.http_server import get_global_state, health_generate
from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.internal_state import _DECODE_GRAPH_PHASES
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.runtime_context import get_disagg, get_parallel
from sglang.srt.utils.network import NetworkAddress, config_socket

from sglang_dsv4.register import Add, Fix, Replace, Routes

_CONN = "sglang.srt.disaggregation.nixl.conn"
_MANAGER = f"{_CONN}.NixlKVManager"
_HTTP = "sglang.srt.entrypoints.http_server"
_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"


# --- written as they would stand in sglang/srt/disaggregation/nixl/conn.py ---------------------


def _describe_nixl_control_message(
    frames: list[bytes],
) -> tuple[str, str | None, int | None]:
    """(kind, peer, room) of a control message as far as its frames tell; never raises."""

    def text_at(index):
        if index is None or index >= len(frames) or not frames[index]:
            return None
        return bytes(frames[index][:64]).decode("ascii", "replace")

    def room_at(index):
        try:
            return int(bytes(frames[index]).decode("ascii"))
        except (TypeError, IndexError, ValueError, UnicodeDecodeError):
            return None

    if not frames or frames == [b""]:
        return "empty", None, None
    tag = bytes(frames[0])
    if tag == GUARD:
        # After the guard: room ("None" for a registration), ip, port, agent name.
        if len(frames) == 1:
            return "guard_only", None, None
        kind = "registration" if frames[1] == b"None" else "transfer_info"
        return kind, text_at(4), room_at(1)
    # Tagged messages: tag -> (frame with the room, frame naming the sender).
    frame_of = {
        b"ABORT": (1, 2),
        b"STAGING_RSP": (1, 6),
        b"WATERMARK": (None, 3),
        b"STAGING_REQ": (1, 4),
        b"CHUNK_READY": (1, 5),
        b"ABORT_ACK": (1, None),
        NixlKVManager.kv_status_msg_tag: (1, None),
    }
    if tag not in frame_of:
        return "foreign", None, None
    room_index, peer_index = frame_of[tag]
    room = None if room_index is None else room_at(room_index)
    return tag.decode("ascii").lower(), text_at(peer_index), room


def _decode_endpoint_of_message(frames: list[bytes]) -> tuple[str, int] | None:
    """The status endpoint (ip, port) a decode's GUARD message names, if it decodes; never raises."""
    try:
        if bytes(frames[0]) != GUARD:
            return None
        return bytes(frames[2]).decode("ascii"), int(bytes(frames[3]).decode("ascii"))
    except (IndexError, TypeError, ValueError, UnicodeDecodeError):
        return None


def _start_bootstrap_thread(self):
    return self._start_control_thread(
        "prefill_bootstrap",
        self._handle_prefill_control_message,
        self._fail_rooms_awaiting_bootstrap,
    )


def _start_decode_listener_thread(self):
    # Every decode needs it, staging or not: prefill reports each room's outcome through it.
    return self._start_control_thread(
        "decode_listener",
        self._handle_decode_control_message,
        self._fail_rooms_awaiting_prefill,
    )


def _start_control_thread(self, role: str, handle_message, fail_waiting_rooms) -> threading.Thread:
    if not hasattr(self, "control_thread_events"):
        # (thread role, event) -> count, for this manager; the metric sums all managers.
        self.control_thread_events = {}
    if not hasattr(self, "_control_drop_log"):
        # (thread role, message kind) -> (last logged, left out since): rate-limits drop lines.
        self._control_drop_log = {}
    # Created here, on the constructing thread, so the control threads never race to create it.
    try:
        self._control_thread_event_counter()
    except Exception:
        logger.exception("NIXL control-thread metric could not be created; counting per manager")
    thread = threading.Thread(
        target=self._run_control_thread,
        args=(role, handle_message, fail_waiting_rooms),
        name=f"nixl-{role}",
        daemon=True,
    )
    self._control_thread_state(role)["thread"] = thread
    thread.start()
    return thread


def _control_thread_event_counter(self):
    # One counter per process, shared by every manager in it.
    counter = NixlKVManager.__dict__.get("_control_thread_events_total")
    if counter is None:
        from prometheus_client import Counter

        counter = Counter(
            "sglang:nixl_control_thread_events_total",
            "NIXL connector control-thread events: dropped bad messages, "
            "isolated handler errors and thread deaths (each followed by a restart).",
            labelnames=["thread", "event"],
        )
        NixlKVManager._control_thread_events_total = counter
    return counter


def _count_control_thread_event(self, role: str, event: str) -> int:
    """Count an event per manager and in the metric; never raises (it runs on failure paths)."""
    if not hasattr(self, "control_thread_events"):
        self.control_thread_events = {}  # the heartbeat may count before any control thread
    key = (role, event)
    self.control_thread_events[key] = self.control_thread_events.get(key, 0) + 1
    try:
        self._control_thread_event_counter().labels(thread=role, event=event).inc()
    except Exception as e:
        # A metric that cannot be written (say, its multiprocess directory vanished) must not
        # stop the failure path it reports on; say so once per manager.
        if not self.__dict__.setdefault("_control_metric_failed", False):
            self._control_metric_failed = True
            logger.error(
                "NIXL control-thread metric not updated (%s: %s); events are still counted "
                "per manager (control_thread_events)",
                type(e).__name__,
                e,
            )
    return self.control_thread_events[key]


def _run_control_thread(
    self,
    role: str,
    handle_message,
    fail_waiting_rooms,
    first_backoff_s: float = 0.1,
    max_backoff_s: float = 10.0,
) -> None:
    """Serve the control socket for good: a death fails the waiting rooms, then restarts."""
    state = self._control_thread_state(role)
    backoff_s = first_backoff_s
    socket_errors_in_a_row = 0
    while True:
        started = time.monotonic()
        received_before = state["received"]
        try:
            self._serve_control_messages(handle_message, role)
        except zmq.ContextTerminated:
            self.server_socket.close(linger=0)
            state["stopped"] = "its ZMQ context was terminated"
            logger.info("NIXL %s thread stops: its ZMQ context was terminated", role)
            return
        except Exception as e:
            if self.server_socket.closed:
                state["stopped"] = "its socket was closed"
                logger.info("NIXL %s thread stops: its socket was closed", role)
                return
            # Nothing below may raise: this is what keeps the rooms and the thread alive.
            reason = (
                f"NIXL {role} thread on engine_rank={self.kv_args.engine_rank} died "
                f"({type(e).__name__}: {str(e)[:200]})"
            )
            deaths = self._count_control_thread_event(role, "death")
            state["last_death"], state["last_death_at"] = reason, time.time()
            served = state["received"] != state["received_at_last_death"]
            state["deaths_in_a_row"] = 1 if served else state["deaths_in_a_row"] + 1
            state["received_at_last_death"] = state["received"]
            try:
                failed = fail_waiting_rooms(reason)
            except Exception:
                logger.exception("NIXL %s: failing the waiting rooms raised", role)
                failed = -1
            # A socket that fails again before a single message came through stays broken:
            # close it and bind a new one on the same port, which the peers already know.
            broken = isinstance(e, zmq.ZMQError) and state["received"] == received_before
            socket_errors_in_a_row = socket_errors_in_a_row + 1 if broken else 0
            rebound = socket_errors_in_a_row >= 2 and self._rebind_control_socket(role)
            if rebound:
                socket_errors_in_a_row = 0
            # A thread that served for a while starts its back-off over.
            if time.monotonic() - started > 6 * max_backoff_s:
                backoff_s = first_backoff_s
            try:
                logger.error(
                    "%s; death #%d, %s waiting room(s) failed at once;%s restarting in %.1f s",
                    reason,
                    deaths,
                    failed if failed >= 0 else "no",
                    " socket re-bound;" if rebound else "",
                    backoff_s,
                    exc_info=True,
                )
            except Exception:
                pass
            time.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, max_backoff_s)


def _control_thread_state(self, role: str) -> dict:
    """Liveness record of one control thread (read by control_thread_health)."""
    states = self.__dict__.setdefault("control_thread_states", {})
    return states.setdefault(
        role,
        {
            "received": 0,
            "last_death": None,
            "last_death_at": None,
            "stopped": None,
            # Deaths with no message served between them, and `received` at the last one.
            "deaths_in_a_row": 0,
            "received_at_last_death": None,
        },
    )


def control_thread_health(self, deaths_in_vain: int = 3, within_s: float = 30.0) -> dict:
    """Per control thread: alive, deaths (each followed by a restart), the last death's reason
    and time, why it stopped if it did, and `down`: why it cannot serve, or None.

    A thread is down when it has stopped, or when its restarts are in vain: `deaths_in_vain`
    deaths in a row without a message served between them, the last within `within_s` (three
    times the longest back-off, so a thread that has waited that long since is serving again).
    `healthy` is False while one is down. Plain values only: read through get_internal_state.
    """
    threads = {}
    events = self.__dict__.get("control_thread_events", {})
    for role, state in dict(self.__dict__.get("control_thread_states", {})).items():
        thread = state.get("thread")
        alive = thread is not None and thread.is_alive()
        in_a_row = state["deaths_in_a_row"]
        if not alive:
            down = f"stopped: {state['stopped'] or 'the thread ended'}"
        elif (
            in_a_row >= deaths_in_vain
            and state["received"] == state["received_at_last_death"]
            and time.time() - state["last_death_at"] < within_s
        ):
            down = f"restarting in vain: died {in_a_row} times in a row without serving a message"
        else:
            down = None
        threads[role] = {
            "alive": alive,
            "down": down,
            "deaths": events.get((role, "death"), 0),
            "deaths_in_a_row": in_a_row,
            "last_death": state["last_death"],
            "last_death_at": state["last_death_at"],
            "stopped": state["stopped"],
        }
    return {
        "engine_rank": self.kv_args.engine_rank,
        "healthy": not any(t["down"] for t in threads.values()),
        "threads": threads,
    }


def _rebind_control_socket(self, role: str) -> bool:
    """Replace the control socket by a new one bound on the same port; False if it cannot be."""
    address = NetworkAddress(self.local_ip, self.rank_port)
    try:
        self.server_socket.close(linger=0)
    except Exception:
        logger.exception("NIXL %s: closing the broken control socket raised", role)
    # The closed socket releases its port asynchronously: retry for up to a second.
    for _ in range(50):
        sock = self._zmq_ctx.socket(zmq.PULL)
        try:
            config_socket(sock, zmq.PULL)
            if address.is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(address.to_tcp())
        except zmq.ZMQError as e:
            sock.close(linger=0)
            if e.errno != errno.EADDRINUSE:
                logger.error("NIXL %s: cannot re-bind %s: %s", role, address.to_tcp(), e)
                return False
            time.sleep(0.02)
            continue
        self.server_socket = sock
        self._count_control_thread_event(role, "socket_rebound")
        logger.warning("NIXL %s: control socket %s closed and re-bound", role, address.to_tcp())
        return True
    logger.error("NIXL %s: %s stayed in use; the socket was not re-bound", role, address.to_tcp())
    return False


def _serve_control_messages(self, handle_message, role: str) -> None:
    state = self._control_thread_state(role)
    receive = self.server_socket.recv_multipart
    while True:
        frames = receive()
        state["received"] += 1
        try:
            handle_message(frames)
        except Exception as e:
            self._drop_control_message(role, frames, e)


def _drop_control_message(
    self, role: str, frames: list[bytes], error: Exception, log_interval_s: float = 10.0
) -> None:
    kind, peer, room = _describe_nixl_control_message(frames)
    self._count_control_thread_event(role, "dropped_message")
    error_text = f"{type(error).__name__}: {str(error)[:200]}"
    reason = f"NIXL {role} could not handle a {kind} message for this room ({error_text})"
    decode = _decode_endpoint_of_message(frames) if kind == "transfer_info" else None
    if room is None:
        room_failed = False
    elif role == "prefill_bootstrap" and kind == "transfer_info":
        # The decode that sent it waits for this room too: tell it, and fail the room here
        # now or, if the prefill has not opened it yet, as soon as it does.
        room_failed = self._refuse_room(room, reason, decode)
    else:
        room_failed = self._fail_live_room(room, reason)
    # One line per (thread, kind) and interval; the next line says how many were left out.
    now = time.monotonic()
    last_logged, left_out = self._control_drop_log.get((role, kind), (None, 0))
    if last_logged is not None and now - last_logged < log_interval_s:
        self._control_drop_log[(role, kind)] = (last_logged, left_out + 1)
        return
    self._control_drop_log[(role, kind)] = (now, 0)
    logger.warning(
        "NIXL %s dropped a bad %s message (peer=%s, room=%s%s%s): %s%s",
        role,
        kind,
        peer or "unknown",
        "unknown" if room is None else room,
        ", room failed" if room_failed else "",
        ", decode told" if decode is not None and room is not None else "",
        error_text,
        f" [{left_out} more like it in the last {now - last_logged:.0f} s]" if left_out else "",
    )


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
        self._remember_failed_room(room, reason, opened=False)
    if decode is not None:
        self.send_kv_status_message(
            targets=[decode], bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
        )
    return failed_here


def _remember_failed_room(self, room: int, reason: str, opened: bool) -> None:
    """Keep why a room failed for a while, so that a late transfer info for it is answered
    (`opened`) or the room fails as soon as the prefill opens it (not `opened`)."""
    rooms = self.__dict__.setdefault("_failed_rooms", OrderedDict())
    now = time.monotonic()
    with self.__dict__.setdefault("_failed_rooms_lock", threading.Lock()):
        rooms.pop(room, None)
        rooms[room] = (reason, opened, now)
        # Bounded: the oldest go first, and none is kept past ten minutes.
        while rooms and (len(rooms) > 4096 or now - next(iter(rooms.values()))[2] > 600):
            rooms.popitem(last=False)


def _recall_failed_room(self, room: int, forget: bool = False) -> tuple[str, bool] | None:
    rooms = self.__dict__.get("_failed_rooms")
    if not rooms:
        return None
    with self.__dict__.setdefault("_failed_rooms_lock", threading.Lock()):
        entry = rooms.pop(room, None) if forget else rooms.get(room)
    return None if entry is None else entry[:2]


def update_status(self, bootstrap_room: int, status: KVPoll):
    """The common status update; on a prefill, a room that fails also tells its decode ranks.

    Every failure path (sender abort, bootstrap timeout, control-thread death, a refused
    message) ends here, so decode learns at once instead of at its waiting timeout.
    """
    if self.disaggregation_mode != DisaggregationMode.PREFILL:
        return CommonKVManager.update_status(self, bootstrap_room, status)
    before = self.request_status.get(bootstrap_room)
    CommonKVManager.update_status(self, bootstrap_room, status)
    if before is None:
        if bootstrap_room in self.request_status:
            self._on_room_opened(bootstrap_room)
    elif status == KVPoll.Failed and before != KVPoll.Failed:
        self._on_room_failed(bootstrap_room)


def _on_room_opened(self, room: int) -> None:
    remembered = self._recall_failed_room(room, forget=True)
    if remembered is None:
        return
    reason, opened = remembered
    if not opened:
        # A decode's message for this room was refused before the prefill opened it.
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
    # Else a new request reuses the number of a room that failed: it starts clean.


def _on_room_failed(self, room: int) -> None:
    """Tell the room's decode ranks it failed, with the reason; never raises."""
    try:
        with self.failure_lock:
            reason = self.failure_records.get(room)
        self._remember_failed_room(room, reason or self.DEFAULT_PREFILL_FAILURE_REASON, True)
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
    failures = self.__dict__.setdefault("failed_decode_registrations", {})
    if failures.get(peer) != cause:
        logger.error(
            "Decode peer %s could not register with prefill engine_rank=%s (%s); every room "
            "it sends fails at once until it registers successfully",
            peer,
            self.kv_args.engine_rank,
            cause,
        )
    failures[peer] = cause


def _transfer_info_refusal(self, info: TransferInfo) -> str | None:
    """Why this transfer info must not be stored, or None."""
    cause = self.__dict__.get("failed_decode_registrations", {}).get(info.agent_name)
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
        remembered = self._recall_failed_room(info.room)
        if remembered is not None:
            return remembered[0]
    return None


def _room_status_snapshot(self) -> list[tuple[int, int]]:
    statuses = self.request_status
    if not isinstance(statuses, dict):
        # PP prefill: a PPConsensusStore, whose local map holds this rank's statuses.
        statuses = statuses._local_map
    return list(statuses.items())


def _fail_rooms_awaiting_bootstrap(self, reason: str) -> int:
    waiting = [
        room
        for room, status in self._room_status_snapshot()
        if status == KVPoll.Bootstrapping
    ]
    return sum(self._fail_live_room(room, reason) for room in waiting)


def _fail_rooms_awaiting_prefill(self, reason: str) -> int:
    return sum(
        self._fail_live_room(room, reason) for room, _ in self._room_status_snapshot()
    )


def _handle_prefill_control_message(self, frames: list[bytes]) -> None:
    """Handle one message from a decode rank; raises if it cannot be handled."""
    tag = frames[0]
    if tag == b"WATERMARK" or tag == b"STAGING_RSP":
        # Staging: decode's consumption watermark, or the staging offset it allocated.
        if not self.enable_staging:
            return
        if tag == b"WATERMARK":
            handle_watermark_msg(self._staging_ctx, frames)
        else:
            handle_staging_rsp(frames, self.transfer_infos)
        return
    if tag == ABORT_TAG:
        # A room failed on a decode's ABORT is not reported back to it.
        self._decode_abort_thread = threading.get_ident()
        try:
            if self._handle_abort_notification(frames):
                return
        finally:
            self._decode_abort_thread = None
    if tag != GUARD:
        raise ValueError(f"first frame is not {GUARD!r}: foreign traffic?")
    if frames[1] == b"None":
        self._register_decode_peer(frames[1:])
    else:
        self._store_transfer_info(TransferInfo.from_zmq(frames[1:]))


def _register_decode_peer(self, frames: list[bytes]) -> None:
    try:
        name = bytes(frames[3]).decode("ascii")
    except (IndexError, UnicodeDecodeError):
        name = None
    try:
        peer = KVArgsRegisterInfo.from_zmq(frames)
        name = peer.agent_name
        was_known = name in self.decode_kv_args_table
        try:
            self._add_remote_peer(peer)
        except Exception:
            if not was_known:
                # Half-registered, the peer's next registration would be ignored as a duplicate.
                self.decode_kv_args_table.pop(name, None)
            raise
    except Exception as e:
        if name is not None and name not in self.decode_kv_args_table:
            self._record_failed_registration(name, e)
        raise
    cleared = self.__dict__.get("failed_decode_registrations", {}).pop(name, None)
    if cleared is not None:
        logger.info("Decode peer %s registered; its earlier failure (%s) is cleared", name, cleared)
    logger.debug("Registered KVArgs of decode peer %s", name)


def _store_transfer_info(self, info: TransferInfo) -> None:
    room = info.room
    refusal = self._transfer_info_refusal(info)
    if refusal is not None:
        # Never stored: the room must not become ready, and its decode hears why at once.
        self._refuse_room(room, refusal, (info.endpoint, info.dst_port))
        return
    infos = self.transfer_infos.setdefault(room, {})
    infos[info.agent_name] = info
    logger.debug(
        "transfer info for room=%s from %s (%d of %d)",
        room,
        info.agent_name,
        len(infos),
        info.required_dst_info_num,
    )
    if len(infos) != info.required_dst_info_num:
        return
    # Every decode destination of the room has reported: it is bootstrapped.
    self.resolve_kv_replica_factor(infos)
    prefix_lens = [i.decode_prefix_len for i in infos.values()]
    self.req_to_decode_prefix_len[room] = next(
        (n for n in prefix_lens if n is not None), 0
    )
    self.update_status(room, KVPoll.WaitingForInput)


def _handle_decode_control_message(self, frames: list[bytes]) -> None:
    """Handle one message from a prefill rank; raises if it cannot be handled."""
    if frames[0] == b"STAGING_REQ":
        if self.enable_staging:
            self._handle_staging_req(frames)
        return
    if self.handle_chunk_ready(frames) or self.handle_abort_ack_message(frames):
        return
    parsed = self.parse_kv_status_message(frames)
    if parsed is None:
        what = "malformed" if frames[0] == self.kv_status_msg_tag else "unknown"
        raise ValueError(f"{what} message, tag {bytes(frames[0][:20])!r}")
    room, status, prefill_rank, reason = parsed
    self.apply_prefill_status(
        bootstrap_room=room,
        status=status,
        prefill_rank=prefill_rank,
        failure_reason=reason,
    )


def _handle_node_failure(self, failed_bootstrap_addr: str):
    """Run the common failure handling without letting it end the heartbeat thread.

    The heartbeat checker guards only its HTTP probe. If the handling raises (a room
    cleared between its `in` check and check_status, a malformed cached endpoint),
    fail the rooms tracked for that prefill here instead.
    """
    with self.connection_lock:
        rooms = list(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, ()))
    try:
        CommonKVManager._handle_node_failure(self, failed_bootstrap_addr)
    except Exception as e:
        self._count_control_thread_event("decode_heartbeat", "error")
        reason = (
            f"Lost connection with prefill instance (bootstrap_addr: "
            f"{failed_bootstrap_addr})"
        )
        failed = sum(self._fail_live_room(room, reason) for room in rooms)
        # Forget the prefill as the common handling would, so it is not probed and failed again,
        # and drop its cached rank endpoints: a restarted prefill gets fresh ones and this
        # decode's registration again.
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
        logger.error(
            "Handling the loss of prefill %s raised %s: %s; failed its %d live room(s) "
            "directly, the heartbeat thread goes on",
            failed_bootstrap_addr,
            type(e).__name__,
            e,
            failed,
            exc_info=True,
        )


# --- written as they would stand in .../managers/scheduler_components/internal_state.py --------


def _add_disaggregation(self, state) -> None:
    # The PD role, the decode CUDA-graph batch sizes and their memory (what a router feeds back
    # on a role switch), and the health of the NIXL control threads behind this scheduler.
    scheduler = self.scheduler
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is None:
        return  # init_disaggregation has not run yet
    graph_gb = state["memory_usage"]["graph"]
    state["disaggregation_mode"] = mode.value
    state["decode_cuda_graph_bs"] = scheduler.tp_worker.get_decode_cuda_graph_bs()
    decode_graphs_gb = sum(graph_gb[phase] for phase in _DECODE_GRAPH_PHASES)
    state["decode_cuda_graph_memory_gb"] = round(decode_graphs_gb, 3)
    nixl_control_threads = self._nixl_control_threads()
    if nixl_control_threads is not None:
        state["nixl_control_threads"] = nixl_control_threads


def _nixl_control_threads(self) -> list | None:
    """control_thread_health() of this scheduler's NIXL manager, one entry per rank that handles
    this request, or None without a NIXL manager (another transfer backend, no PD).

    Each TP rank runs its own control threads, and only rank 0 answers the tokenizer: without DP
    attention every TP rank handles each control request in the same order (it is broadcast over
    the TP group), so they all reach this gather. With DP attention each DP leader reports
    itself."""
    scheduler = self.scheduler
    queue = scheduler.disagg_prefill_bootstrap_queue
    if queue is None:
        queue = scheduler.disagg_decode_prealloc_queue
    health = getattr(getattr(queue, "kv_manager", None), "control_thread_health", None)
    if health is None:
        return None
    mine = health()
    group = scheduler.tp_group
    if get_parallel().attn_dp_enabled or group.world_size == 1:
        return [mine]
    return group.all_gather_object(mine)


# --- written as they would stand in sglang/srt/entrypoints/http_server.py ----------------------


async def health_with_nixl_control_threads(request: Request) -> Response:
    """`/health` and `/health_generate` of a PD server: 503, naming the thread, while a NIXL
    control thread of a scheduler rank is down (stopped, or restarting in vain); otherwise
    upstream's probe, health_generate."""
    manager = get_global_state().tokenizer_manager
    if (
        get_disagg().disaggregation_mode != DisaggregationMode.NULL.value
        and manager.server_status != ServerStatus.Starting
        and not manager.gracefully_exit
        and not envs.SGLANG_DIAG_BYPASS_HEALTH_GENERATE.get()
    ):
        down = await _nixl_control_threads_down(manager)
        if down:
            manager.server_status = ServerStatus.UnHealthy
            return Response(content=down, status_code=503, media_type="text/plain")
    return await health_generate(request)


async def _nixl_control_threads_down(manager, timeout_s: float = 5.0) -> str | None:
    """Why a NIXL control thread of a scheduler rank cannot serve (one line), or None.

    Read through get_internal_state, bounded by `timeout_s`: a scheduler that does not answer
    is left to health_generate's probe. A change is logged once; the server is marked Up again
    when the threads it was marked UnHealthy for serve again."""
    # The http server's logger under either delivery (this function's module differs).
    log = logging.getLogger(health_generate.__module__)
    try:
        states = await asyncio.wait_for(manager.get_internal_state(), timeout_s)
    except asyncio.TimeoutError:
        log.warning("Health check: no NIXL control-thread state within %.0f s", timeout_s)
        return None
    down = [
        f"NIXL {role} thread on engine_rank={rank['engine_rank']} is {thread['down']}"
        + (f" (last death: {thread['last_death']})" if thread["last_death"] else "")
        for state in states
        for rank in state.get("nixl_control_threads") or ()
        for role, thread in rank["threads"].items()
        if thread["down"]
    ]
    cause = "; ".join(down) or None
    if cause != getattr(manager, "nixl_control_threads_down", None):
        if cause:
            log.error("Health check failed: %s", cause)
        else:
            log.info("Health check: the NIXL control threads serve again")
            if manager.server_status == ServerStatus.UnHealthy:
                manager.server_status = ServerStatus.Up
        manager.nixl_control_threads_down = cause
    return cause


# --- the register entry ------------------------------------------------------------------------

FIX = Fix(
    id="nixl-bootstrap-cascade",
    title="NIXL control threads survive bad messages; waiting rooms fail at once if one dies",
    area="disaggregation",
    why=(
        "One thread on each prefill rank (NixlKVManager._start_bootstrap_thread) receives "
        "everything decode ranks send. In 0.5.23 any exception ends it: a foreign message fails "
        "the guard assert, a truncated or undecodable one raises while parsed, and the guarded "
        "wrapper only logs and re-raises. From then on no request to that rank leaves "
        "KVPoll.Bootstrapping until the bootstrap timeout (300 s), and decode aborts request "
        "after request: the cascade that wedged production. Decode's listener thread has no "
        "guard at all (a STAGING_REQ that fails to parse ends it, and rooms wait out the waiting "
        "timeout), and decode's heartbeat checker calls _handle_node_failure outside its guard, "
        "so one exception there ends prefill failure detection for good. Failures also stopped "
        "at the prefill: a room failed there left its decode waiting 300 s, a transfer info for "
        "a failed room was stored silently, the decode behind a malformed message was never "
        "told, a refused decode registration let the peer's rooms go ready and fail only at the "
        "transfer, a raising metric ended the thread, a broken socket was never replaced, and "
        "the heartbeat fallback kept a lost prefill's cached endpoints, and /health stayed 200 "
        "with a control thread gone (its probe bypasses NIXL and passes on any scheduler output)."
    ),
    how=(
        "Both control threads run one supervised loop that handles each message in its own try. "
        "A bad message is dropped with a log line rate-limited per (thread, kind), naming kind, "
        "peer and room when known; a live room it names is failed with the reason (prefill: "
        "conclude_failure, which tells the decode ranks too; Failed stays terminal); ABORT for "
        "an unknown or finished room stays a no-op; a registration that fails half-way is rolled "
        "back. If the loop dies anyway, the rooms waiting on it fail at once (prefill: every "
        "Bootstrapping room; decode: every unfinished room) and it restarts after 0.1 s, "
        "doubling to 10 s while it keeps dying; a terminated context or closed socket stops it. "
        "Drops, deaths and isolated heartbeat errors are counted per manager "
        "(control_thread_events) and in sglang:nixl_control_thread_events_total{thread,event}. "
        "Audited: transfer_worker already isolates each chunk (no change); decode listener "
        "(fixed); heartbeat checker (NixlKVManager._handle_node_failure isolates the failure "
        "handling and fails the tracked rooms itself if it raises); bootstrap server and "
        "prefill-recompute pool isolate per request (no change). A prefill room turning Failed "
        "tells its decode ranks with the reason (not on the decode's own ABORT); failed rooms are "
        "remembered (4,096 rooms, 10 min) so a late transfer info is answered Failed, not stored; "
        "a malformed transfer info is answered to the endpoint it names; a refused registration "
        "is recorded per peer (ERROR once per cause) and fails each of its rooms until it "
        "registers again; the metric and the death path cannot raise; a socket failing twice "
        "with nothing received is re-bound on its port; the heartbeat fallback drops the lost "
        "prefill's cached endpoints; control_thread_health() reports liveness, last death and "
        "whether a thread is down (stopped, or 3 deaths in a row without serving a message). "
        "The scheduler's state readback carries every TP rank's thread health "
        "(nixl_control_threads, also in /server_info), and /health and /health_generate of a "
        "PD server answer 503 with one line naming the thread, rank and cause while one is "
        "down (server marked UnHealthy, ERROR logged once, Up again when they serve), then run "
        "upstream's health_generate unchanged."
    ),
    upstream=(
        "not upstream; PR #30352 (ABORT handled in this thread) and PR #34692 (bootstrap "
        "timeout) are; PR #35281's loop guards were dropped in review"
    ),
    remove_when=(
        "upstream's NIXL control threads isolate each message, fail waiting rooms when a thread "
        "dies, and restart it."
    ),
    tests=(
        "test/behaviour/test_nixl_bootstrap.py",
        "test/behaviour/test_pd_fail_fast.py",
        "test/behaviour/test_pd_two_process.py",
        "test/behaviour/test_pd_health.py",
    ),
    targets=(
        f"{_MANAGER}._start_bootstrap_thread",
        f"{_MANAGER}._start_decode_listener_thread",
        f"{_MANAGER}._handle_node_failure",
        f"{_MANAGER}.update_status",
        f"{_STATE}._add_disaggregation",
        f"{_HTTP}.health_generate",
    ),
    replaces=(
        Replace(f"{_MANAGER}._start_bootstrap_thread", _start_bootstrap_thread, "(self)"),
        Replace(
            f"{_MANAGER}._start_decode_listener_thread", _start_decode_listener_thread, "(self)"
        ),
        Replace(f"{_STATE}._add_disaggregation", _add_disaggregation, "(self, state)"),
    ),
    adds=(
        Add(_CONN, _describe_nixl_control_message),
        Add(_MANAGER, _start_control_thread),
        Add(_MANAGER, _control_thread_event_counter),
        Add(_MANAGER, _count_control_thread_event),
        Add(_MANAGER, _run_control_thread),
        Add(_MANAGER, _serve_control_messages),
        Add(_MANAGER, _drop_control_message),
        Add(_MANAGER, _fail_live_room),
        Add(_MANAGER, _room_status_snapshot),
        Add(_MANAGER, _fail_rooms_awaiting_bootstrap),
        Add(_MANAGER, _fail_rooms_awaiting_prefill),
        Add(_MANAGER, _handle_prefill_control_message),
        Add(_MANAGER, _register_decode_peer),
        Add(_MANAGER, _store_transfer_info),
        Add(_MANAGER, _handle_decode_control_message),
        Add(_MANAGER, _handle_node_failure),
        Add(_CONN, _decode_endpoint_of_message),
        Add(_MANAGER, _control_thread_state),
        Add(_MANAGER, control_thread_health),
        Add(_MANAGER, _rebind_control_socket),
        Add(_MANAGER, _refuse_room),
        Add(_MANAGER, _remember_failed_room),
        Add(_MANAGER, _recall_failed_room),
        Add(_MANAGER, update_status),
        Add(_MANAGER, _on_room_opened),
        Add(_MANAGER, _on_room_failed),
        Add(_MANAGER, _record_failed_registration),
        Add(_MANAGER, _transfer_info_refusal),
        Add(_STATE, _nixl_control_threads),
        Add(
            _HTTP,
            health_with_nixl_control_threads,
            takes_routes=Routes("health_generate", "(request)"),
        ),
        Add(_HTTP, _nixl_control_threads_down),
    ),
    imports={
        _CONN: (
            "import errno",
            "import zmq",
            "from collections import OrderedDict",
            "from sglang.srt.utils.network import NetworkAddress, config_socket",
        )
    },
)
