"""The control threads' supervision (nixl-bootstrap-cascade): the supervised loop both control
threads run, its restarts, heartbeat and health, the re-bound socket, and dropped messages.

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import errno
import threading
import time
from types import SimpleNamespace

import zmq
from sglang.srt.disaggregation.nixl.conn import GUARD, NixlKVManager, logger
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress, config_socket


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
        b"PD_PING": (None, 1),
        b"PD_PONG": (None, 1),
        b"PD_ROOM_FAILED": (1, None),
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
    return self._start_control_thread("prefill_bootstrap")


def _start_decode_listener_thread(self):
    # Every decode needs it, staging or not: prefill reports each room's outcome through it.
    return self._start_control_thread("decode_listener")


def _start_control_thread(self, role: str) -> threading.Thread:
    self._pd_control()
    # Created here, on the constructing thread, so the control threads never race to create it.
    try:
        self._control_thread_event_counter()
    except Exception:
        logger.exception("NIXL control-thread metric could not be created; counting per manager")
    thread = threading.Thread(target=self._run_control_thread, name=f"nixl-{role}", daemon=True)
    self._control_thread_state(role).thread = thread
    thread.start()
    return thread


def _control_thread_event_counter(self):
    # One counter per process, shared by every manager in it.
    counter = NixlKVManager.__dict__.get("_control_thread_events_total")
    if counter is None:
        from prometheus_client import Counter

        counter = Counter(
            "sglang:nixl_control_thread_events_total",
            "NIXL connector control-thread events: dropped bad messages, isolated handler "
            "errors, thread deaths (each followed by a restart), peers dropped for not draining "
            "their send queue and sends skipped to them.",
            labelnames=["thread", "event"],
        )
        NixlKVManager._control_thread_events_total = counter
    return counter


def _count_control_thread_event(self, role: str, event: str) -> int:
    """Count an event per manager and in the metric; never raises (it runs on failure paths)."""
    pd = self._pd_control()
    key = (role, event)
    pd.events[key] = pd.events.get(key, 0) + 1
    try:
        self._control_thread_event_counter().labels(thread=role, event=event).inc()
    except Exception as e:
        # A metric that cannot be written (say, its multiprocess directory vanished) must not
        # stop the failure path it reports on; say so once per manager.
        if not pd.metric_failed:
            pd.metric_failed = True
            logger.error(
                "NIXL control-thread metric not updated (%s: %s); events are still counted "
                "per manager (control_thread_events)",
                type(e).__name__,
                e,
            )
    return pd.events[key]


def _run_control_thread(self) -> None:
    """The thread target of this rank's control socket, as upstream's takes no argument: the
    prefill's bootstrap thread or the decode's listener, by the manager's mode."""
    if self.disaggregation_mode == DisaggregationMode.PREFILL:
        self._supervise_control_thread(
            "prefill_bootstrap",
            self._handle_prefill_control_message,
            self._fail_rooms_awaiting_bootstrap,
        )
    else:
        self._supervise_control_thread(
            "decode_listener",
            self._handle_decode_control_message,
            self._fail_rooms_awaiting_prefill,
        )


def _supervise_control_thread(
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
        received_before = state.received
        try:
            self._serve_control_messages(handle_message, role)
        except zmq.ContextTerminated:
            self.server_socket.close(linger=0)
            state.stopped = "its ZMQ context was terminated"
            logger.info("NIXL %s thread stops: its ZMQ context was terminated", role)
            return
        except Exception as e:
            if self.server_socket.closed:
                state.stopped = "its socket was closed"
                logger.info("NIXL %s thread stops: its socket was closed", role)
                return
            # Nothing below may raise: this is what keeps the rooms and the thread alive.
            reason = (
                f"NIXL {role} thread on engine_rank={self.kv_args.engine_rank} died "
                f"({type(e).__name__}: {str(e)[:200]})"
            )
            deaths = self._count_control_thread_event(role, "death")
            state.last_death, state.last_death_at = reason, time.time()
            served = state.received != state.received_at_last_death
            state.deaths_in_a_row = 1 if served else state.deaths_in_a_row + 1
            state.received_at_last_death = state.received
            try:
                failed = fail_waiting_rooms(reason)
            except Exception:
                logger.exception("NIXL %s: failing the waiting rooms raised", role)
                failed = -1
            # A socket that fails again before a single message came through stays broken:
            # close it and bind a new one on the same port, which the peers already know.
            broken = isinstance(e, zmq.ZMQError) and state.received == received_before
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
            # Sleeping on purpose is progress: the heartbeat is due when the loop restarts.
            state.beat_at = time.monotonic() + backoff_s
            time.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, max_backoff_s)


def _control_thread_state(self, role: str) -> SimpleNamespace:
    """Liveness record of one control thread (read by control_thread_health)."""
    threads = self._pd_control().threads
    state = threads.get(role)
    if state is None:
        state = threads.setdefault(
            role,
            SimpleNamespace(
                thread=None,
                received=0,  # messages taken off the socket
                beat_at=time.monotonic(),  # when its loop last came round
                last_death=None,
                last_death_at=None,
                stopped=None,
                # deaths with no message served between them, and `received` at the last one
                deaths_in_a_row=0,
                received_at_last_death=None,
            ),
        )
    return state


def control_thread_health(
    self, deaths_in_vain: int = 3, within_s: float = 30.0, stalled_s: float | None = None
) -> dict:
    """Per control thread: alive, deaths (each followed by a restart), the last death's reason
    and time, why it stopped if it did, the age of its loop heartbeat, and `down`: why it cannot
    serve, or None.

    A thread is down when it has stopped; when its restarts are in vain (`deaths_in_vain`
    deaths in a row without a message served between them, the last within `within_s`, three
    times the longest back-off); or when it is stalled: alive, but its loop has not come round
    for `stalled_s` (default: the manager's bound, 10 s; the loop comes round at least every
    0.5 s when idle), as when a handler blocks. `healthy` is False while one is down. Plain
    values only: read through get_internal_state.
    """
    pd = self._pd_control()
    if stalled_s is None:
        stalled_s = pd.bounds.stalled_s
    threads = {}
    now = time.monotonic()
    for role, state in list(pd.threads.items()):
        alive = state.thread is not None and state.thread.is_alive()
        in_a_row = state.deaths_in_a_row
        beat_age_s = max(0.0, now - state.beat_at)
        if not alive:
            down = f"stopped: {state.stopped or 'the thread ended'}"
        elif (
            in_a_row >= deaths_in_vain
            and state.received == state.received_at_last_death
            and time.time() - state.last_death_at < within_s
        ):
            down = f"restarting in vain: died {in_a_row} times in a row without serving a message"
        elif beat_age_s > stalled_s:
            down = (
                f"stalled: its loop has not come round for {beat_age_s:.1f} s "
                f"(bound {stalled_s:g} s; a handler is blocked)"
            )
        else:
            down = None
        threads[role] = {
            "alive": alive,
            "down": down,
            "deaths": pd.events.get((role, "death"), 0),
            "deaths_in_a_row": in_a_row,
            "last_death": state.last_death,
            "last_death_at": state.last_death_at,
            "stopped": state.stopped,
            "heartbeat_age_s": round(beat_age_s, 3),
        }
    return {
        "engine_rank": self.kv_args.engine_rank,
        "healthy": not any(t["down"] for t in threads.values()),
        "threads": threads,
        "tables": self.control_table_sizes(),
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


def _serve_control_messages(self, handle_message, role: str, idle_poll_ms: int = 500) -> None:
    state = self._control_thread_state(role)
    while True:
        # The heartbeat: each turn of the loop, at least every `idle_poll_ms` when idle.
        state.beat_at = time.monotonic()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._expire_parked_transfer_infos()
            self._probe_decode_peers()
        sock = self.server_socket  # re-read: a re-bound socket replaces it
        if not sock.poll(idle_poll_ms):
            continue
        frames = sock.recv_multipart()
        state.received += 1
        try:
            handle_message(frames)
        except Exception as e:
            self._drop_control_message(role, frames, e)


def _drop_control_message(
    self, role: str, frames: list[bytes], error: Exception, log_interval_s: float = 10.0
) -> None:
    kind, peer, room = _describe_nixl_control_message(frames)
    pd = self._pd_control()
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
    last_logged, left_out = pd.drop_log.get((role, kind), (None, 0))
    if last_logged is not None and now - last_logged < log_interval_s:
        pd.drop_log[(role, kind)] = (last_logged, left_out + 1)
        return
    pd.drop_log[(role, kind)] = (now, 0)
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
