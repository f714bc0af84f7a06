"""nixl-bootstrap-cascade: NIXL control threads survive bad messages and never block on a peer; a failed room fails on both sides at once.

Register entry
  Target:      sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_decode_listener_thread
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._handle_node_failure
               sglang.srt.disaggregation.nixl.conn.NixlKVManager.update_status
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._send_multipart_locked
               sglang.srt.disaggregation.decode.DecodeTransferQueue._defer_release
  Why:         One thread on each prefill rank (NixlKVManager._start_bootstrap_thread) receives
               everything decode ranks send. In 0.5.23 any exception ends it: a foreign message
               fails the guard assert, a truncated or undecodable one raises while parsed, and the
               guarded wrapper only logs and re-raises. From then on no request to that rank leaves
               KVPoll.Bootstrapping until the bootstrap timeout (300 s), and decode aborts request
               after request: the cascade that wedged production. Decode's listener thread has no
               guard at all (a STAGING_REQ that fails to parse ends it, and rooms wait out the
               waiting timeout), and decode's heartbeat checker calls _handle_node_failure outside
               its guard, so one exception there ends prefill failure detection for good. Failures
               also stopped at the prefill: a room failed there left its decode waiting 300 s, a
               transfer info for a failed room was stored silently, the decode behind a malformed
               message was never told, a refused decode registration let the peer's rooms go ready
               and fail only at the transfer, a raising metric ended the thread, a broken socket was
               never replaced, and the heartbeat fallback kept a lost prefill's cached endpoints.
               Sends to a peer were synchronous on upstream's cached PUSH socket (30 s send timeout,
               1,000 queued): after about 1,000 notices to a refused decode endpoint each further
               send blocked 30 s on the control thread (or the scheduler's), and a healthy decode's
               room waited 87 s. 10,000 transfer infos for rooms never opened left 10,000 entries in
               each of request_status, transfer_infos and req_to_decode_prefix_len, and an info for
               a room that finished and was cleared brought it back as WaitingForInput. A decode
               that failed a room held its KV slots for the prefill's abort ack only until
               upstream's deferred-release timeout (30 s), then freed them unacknowledged: a prefill
               still writing, hung or cut off could write into slots another request then owned.
  How:         Both control threads run one supervised loop (_run_control_thread, upstream's
               argument-less thread target) that handles each message in its own try. A bad message
               is dropped with a log line rate-limited per (thread, kind), naming kind, peer and
               room when known; a live room it names is failed with the reason (prefill:
               conclude_failure, which tells the decode ranks too; Failed stays terminal); ABORT for
               an unknown or finished room stays a no-op; a registration that fails half-way is
               rolled back. If the loop dies anyway, the rooms waiting on it fail at once (prefill:
               every Bootstrapping room; decode: every unfinished room) and it restarts after 0.1 s,
               doubling to 10 s while it keeps dying; a terminated context or closed socket stops
               it. The loop beats at least every 0.5 s; control_thread_health() reports a thread
               down when it stopped, restarts in vain, or is stalled (heartbeat older than 10 s).
               Sends to peers never block: queued without waiting (at most 1,000 per peer); a peer
               whose queue stays full is dropped (socket closed, counted, logged once), skipped
               (counted) and connected afresh when it registers again. Drops, deaths, isolated
               heartbeat errors and peer drops are counted per manager (control_thread_events) and
               in sglang:nixl_control_thread_events_total{thread,event}. Audited: transfer_worker
               already isolates each chunk (no change); decode listener (fixed); heartbeat checker
               (NixlKVManager._handle_node_failure isolates the failure handling and fails the
               tracked rooms itself if it raises); bootstrap server and prefill-recompute pool
               isolate per request (no change). A prefill room turning Failed tells its decode ranks
               with the reason (not on the decode's own ABORT). Bounded state: a room's outcome is
               remembered (4,096 rooms, 10 min) so a late transfer info for a failed or finished
               room is answered Failed, not stored; infos for a room the prefill has not opened
               create nothing in upstream's tables: they are parked (1,024 rooms, 30 s) until the
               room opens, else answered Failed; a malformed transfer info is answered to the
               endpoint it names; a refused registration is recorded per peer (4,096 peers; ERROR
               once per cause) and fails each of its rooms until it registers again; the metric and
               the death path cannot raise; a socket failing twice with nothing received is re-bound
               on its port; the heartbeat fallback drops the lost prefill's cached endpoints. A NIXL
               decode quarantines the KV slots of a room it failed
               (DecodeTransferQueue._defer_release): held, with no deadline, until every prefill
               rank acks the abort (upstream's ABORT / ABORT_ACK, which carry the abort's
               generation) or the decode's heartbeat declares the prefill dead; counted (events, the
               gauge sglang:nixl_kv_quarantined_slots) and in /server_info; above 4,096 rooms an
               ERROR, never an early free. A prefill writes only under a lease: each heartbeat reply
               grants 2 s from its ping's send time; the transfer worker posts a chunk only with 0.5
               s of lease left on every decode of the room, else pings and waits (at most 5 s, then
               the room fails) and reads the room's status again; a decode frees a dead prefill's
               slots no sooner than 2 s after its last reply and sends no reply while it fails that
               prefill's rooms, so a renewed lease comes after their failure notices.
  Upstream:    not upstream; PR #30352 (ABORT handled in this thread) and PR #34692 (bootstrap
               timeout) are; PR #35281's loop guards were dropped in review
  Remove when: upstream's NIXL control threads isolate each message, fail waiting rooms when a
               thread dies, restart it, never block on a peer, bound their per-room tables, and a
               decode holds a failed room's KV slots until its prefill acks the abort or is declared
               dead and a prefill that was stopped or cut off cannot write before it reads its
               rooms' failures.

How, in detail
  Both control threads run one supervised loop (_run_control_thread(self), the
  argument-less target upstream has): each message is handled in its own try; a bad
  one is dropped with a log line rate-limited per (thread, kind) that names kind,
  peer and room when the frames tell them; a live room the message names is failed
  with the reason (prefill: conclude_failure, which also tells the decode ranks the
  room reached; Failed stays terminal); ABORT for an unknown or finished room stays a
  no-op. A registration that fails half-way is rolled back. If the loop dies anyway,
  the rooms waiting on it fail at once (prefill: every Bootstrapping room; decode:
  every room not yet Success/Failed) and the loop restarts after 0.1 s, doubling to
  at most 10 s while it keeps dying. A terminated ZMQ context or closed socket ends
  it cleanly; two socket errors with nothing received between close the socket and
  bind a new one on the same port. The loop beats at least every 0.5 s (it polls);
  control_thread_health() reports each thread's liveness, deaths, last death, why
  it stopped, the heartbeat's age, and `down`: stopped, restarting in vain (3 deaths
  in a row with no message served, the last within 30 s), or stalled (heartbeat
  older than 10 s: a handler is blocked); nixl-control-health puts it in /health.
  One rule for failures, both directions: a prefill room turning Failed tells its
  decode ranks with the reason (not on the decode's own ABORT); a decode room turning
  Failed for any reason of its own (lost prefill, timeout, abort, listener death)
  sends PD_ROOM_FAILED with its reason to the room's prefill ranks, which fail the
  room ("Decode failed the room: ...") before a transfer starts or concludes; a
  decode failing rooms of a lost prefill keeps that prefill's endpoints for it, so a
  hung or cut-off prefill reads it on waking. Heartbeat both ways: upstream's decode
  probes the prefill's bootstrap server; the prefill pings each decode with a live
  room every 0.5 s on its status socket (the listener answers on the prefill's
  control socket), and a decode that answers none of 4 pings over 5 s (killed, hung,
  cut off) is declared dead: its live rooms fail with "Lost connection with decode
  instance". Silence counts from the first unanswered ping, so a prefill that was
  itself stopped does not declare its decodes dead on waking.
  No control thread or scheduler call blocks on a peer: sends are queued without
  waiting (ZMQ's high-water mark: at most 1,000 per peer); a peer whose queue stays
  full is dropped (its socket closed, counted, logged at ERROR once), sends to it are
  skipped (counted) until it registers again or sends a transfer info, when it is
  connected afresh.
  Bounded state (all in one object per manager, `pd_control`): a room's outcome is
  kept (at most 4,096 rooms, 10 minutes) so a transfer info for a failed or finished
  room is answered Failed instead of stored; infos for a room the prefill has not
  opened create nothing in upstream's tables: they wait (at most 1,024 rooms, 30 s)
  for the room to open, else are answered Failed; refused registrations and dropped
  endpoints at most 4,096 peers each; the prefill's decode links at most one per live
  room. A refused registration is recorded per peer and logged at ERROR once per
  cause; each transfer info from that peer then fails its room at once, until the
  peer registers. A malformed transfer info is answered to the endpoint it names.
  Dropped messages, deaths, isolated heartbeat errors, lost decodes, dropped peers
  and skipped sends are counted per manager (`control_thread_events`) and in the
  Prometheus counter sglang:nixl_control_thread_events_total{thread,event}; the
  metric is written in a try (logged once): the death path cannot raise. The
  heartbeat fallback drops and disconnects the lost prefill's cached endpoints.
  KV slots of a failed room: upstream's decode already holds them (deferred KV
  release) while each prefill rank drains the room and acks the decode's ABORT
  (ABORT_ACK, matched to the abort's generation, so an ack of an older abort does
  not count), but frees them anyway after SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_
  RELEASE_TIMEOUT (30 s). A NIXL decode quarantines them instead
  (DecodeTransferQueue._defer_release holds device destinations with no deadline;
  NixlKVManager.is_abort_release_safe): freed when every prefill rank owed an ack
  sent it, or when the decode's heartbeat declares the prefill dead (a killed
  prefill writes nothing more). The decode holds no NIXL agent of its prefill (the
  prefill holds the decode's), so there is none to remove. A prefill room that could
  not prove its writes drained (upstream poisons its ack) stays quarantined until
  its prefill is declared dead. Counted (control_thread_events: decode_quarantine
  held / released_ack / released_prefill_dead / over_bound; the gauge
  sglang:nixl_kv_quarantined_slots) and in /server_info (quarantined_rooms,
  quarantined_slots). Bound: above 4,096 quarantined rooms an ERROR says so, once
  per crossing; slots are never freed early (admission slows as free slots do).
  Host destinations, and SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0, keep
  upstream's rule.
  A prefill declared dead that comes back (stopped, hung, link cut) must not write
  before it reads the decode's failure of the room: writes are one-sided, the decode
  cannot refuse them. Each ping carries its send time and each reply echoes it; a
  reply grants the prefill a lease on that decode of 2 s from the ping's send time.
  The transfer worker (update_status(Transferring), before a chunk's first write)
  goes on only with 0.5 s of lease left on every decode of the room; else it pings
  them at once and waits for the replies (at most 5 s: then the room fails, "no
  heartbeat reply from decode ... nothing written"), then reads the room's status
  again and refuses a failed room (a NIXL transport error: the worker's own failure
  path, nothing posted). A decode frees the slots of a prefill it declared dead no
  sooner than 2 s after the last reply it sent that prefill's ranks, and sends no
  reply while it fails that prefill's rooms, so a reply after the death follows the
  rooms' failure notices on the same socket. Left open: a write posted under a valid
  lease that the transport cannot finish while the prefill is stopped (UCX over TCP
  moves the bytes from the sender's CPU) may land after the lease.
  Audit of the other long-lived NIXL connector threads: transfer_worker (prefill)
  already catches every exception per chunk and fails the room, no change;
  CommonKVBootstrapServer (aiohttp, per-request isolation) and the
  prefill-recompute thread pool (per-task futures) do not have the pattern.

Modules (each function written as it stands in sglang/srt/disaggregation/nixl/conn.py; this
package's __init__ holds the register entry only)
  supervision  the supervised loop of both control threads: restarts, loop heartbeat, health,
               re-bound socket, dropped messages and the events counted
  peers        sends to peers that never block; a peer that does not drain dropped and skipped
  rooms        the control state (`pd_control`, bounded tables), failing rooms on both sides,
               outcomes remembered, transfer infos parked, refused registrations
  messages     the control messages each side handles
  heartbeat    heartbeat both ways; a decode's failed room told to its prefill ranks
  quarantine   a failed room's KV slots held until the prefill acks or is declared dead
  lease        a prefill writes only under its decode's lease
"""

from __future__ import annotations

from sglang_dsv4.fix import Add, Fix, Replace
from sglang_dsv4.fixes.nixl_bootstrap_cascade.heartbeat import (
    _fail_lost_prefill,
    _handle_node_failure,
    _on_decode_lost,
    _on_decode_pong,
    _on_decode_room_failed,
    _prefill_endpoints_of_address,
    _probe_decode_peers,
    _tell_prefill_room_failed,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.lease import (
    _answer_prefill_ping,
    _await_decode_lease,
    _decode_lease_left,
    _granted_lease_end,
    _ping_decode,
    _renew_decode_lease,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.messages import (
    _handle_decode_control_message,
    _handle_prefill_control_message,
    _register_decode_peer,
    _store_transfer_info,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.peers import (
    _close_peer_socket,
    _drop_peer_endpoint,
    _peer_socket,
    _readmit_peer_endpoint,
    _send_multipart_locked,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.quarantine import (
    _defer_release,
    _note_prefill_dead,
    _publish_quarantined_slots,
    _quarantined_slots_gauge,
    clear_deferred_abort_state,
    is_abort_release_safe,
    quarantine_room,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.rooms import (
    _answer_parked_room,
    _expire_parked_transfer_infos,
    _fail_live_room,
    _fail_rooms_awaiting_bootstrap,
    _fail_rooms_awaiting_prefill,
    _on_room_failed,
    _on_room_opened,
    _park_transfer_info,
    _pd_control,
    _recall_concluded_room,
    _record_failed_registration,
    _refuse_room,
    _remember_concluded_room,
    _room_status_snapshot,
    _transfer_info_refusal,
    control_table_sizes,
    update_status,
)
from sglang_dsv4.fixes.nixl_bootstrap_cascade.supervision import (
    _control_thread_event_counter,
    _control_thread_state,
    _count_control_thread_event,
    _decode_endpoint_of_message,
    _describe_nixl_control_message,
    _drop_control_message,
    _rebind_control_socket,
    _run_control_thread,
    _serve_control_messages,
    _start_bootstrap_thread,
    _start_control_thread,
    _start_decode_listener_thread,
    _supervise_control_thread,
    control_thread_health,
)

_CONN = "sglang.srt.disaggregation.nixl.conn"
_MANAGER = f"{_CONN}.NixlKVManager"
_DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"


# --- the register entry ------------------------------------------------------------------------

FIX = Fix(
    id="nixl-bootstrap-cascade",
    title="NIXL control threads survive bad messages and never block on a peer; a failed room "
    "fails on both sides at once",
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
        "the heartbeat fallback kept a lost prefill's cached endpoints. Sends to a peer were "
        "synchronous on upstream's cached PUSH socket (30 s send timeout, 1,000 queued): after "
        "about 1,000 notices to a refused decode endpoint each further send blocked 30 s on the "
        "control thread (or the scheduler's), and a healthy decode's room waited 87 s. 10,000 "
        "transfer infos for rooms never opened left 10,000 entries in each of request_status, "
        "transfer_infos and req_to_decode_prefix_len, and an info for a room that finished and "
        "was cleared brought it back as WaitingForInput. A decode that failed a room held its "
        "KV slots for the prefill's abort ack only until upstream's deferred-release timeout "
        "(30 s), then freed them unacknowledged: a prefill still writing, hung or cut off could "
        "write into slots another request then owned."
    ),
    how=(
        "Both control threads run one supervised loop (_run_control_thread, upstream's "
        "argument-less thread target) that handles each message in its own try. "
        "A bad message is dropped with a log line rate-limited per (thread, kind), naming kind, "
        "peer and room when known; a live room it names is failed with the reason (prefill: "
        "conclude_failure, which tells the decode ranks too; Failed stays terminal); ABORT for "
        "an unknown or finished room stays a no-op; a registration that fails half-way is rolled "
        "back. If the loop dies anyway, the rooms waiting on it fail at once (prefill: every "
        "Bootstrapping room; decode: every unfinished room) and it restarts after 0.1 s, "
        "doubling to 10 s while it keeps dying; a terminated context or closed socket stops it. "
        "The loop beats at least every 0.5 s; control_thread_health() reports a thread down "
        "when it stopped, restarts in vain, or is stalled (heartbeat older than 10 s). "
        "Sends to peers never block: queued without waiting (at most 1,000 per peer); a peer "
        "whose queue stays full is dropped (socket closed, counted, logged once), skipped "
        "(counted) and connected afresh when it registers again. "
        "Drops, deaths, isolated heartbeat errors and peer drops are counted per manager "
        "(control_thread_events) and in sglang:nixl_control_thread_events_total{thread,event}. "
        "Audited: transfer_worker already isolates each chunk (no change); decode listener "
        "(fixed); heartbeat checker (NixlKVManager._handle_node_failure isolates the failure "
        "handling and fails the tracked rooms itself if it raises); bootstrap server and "
        "prefill-recompute pool isolate per request (no change). A prefill room turning Failed "
        "tells its decode ranks with the reason (not on the decode's own ABORT). Bounded "
        "state: a room's outcome is remembered (4,096 rooms, 10 min) so a late transfer info "
        "for a failed or finished room is answered Failed, not stored; infos for a room the "
        "prefill has not opened create nothing in upstream's tables: they are parked (1,024 "
        "rooms, 30 s) until the room opens, else answered Failed; a malformed transfer info is "
        "answered to the endpoint it names; a refused registration is recorded per peer (4,096 "
        "peers; ERROR once per cause) and fails each of its rooms until it registers again; the "
        "metric and the death path cannot raise; a socket failing twice with nothing received "
        "is re-bound on its port; the heartbeat fallback drops the lost prefill's cached "
        "endpoints. A NIXL decode quarantines the KV slots of a room it failed "
        "(DecodeTransferQueue._defer_release): held, with no deadline, until every prefill rank "
        "acks the abort (upstream's ABORT / ABORT_ACK, which carry the abort's generation) or "
        "the decode's heartbeat declares the prefill dead; counted (events, the gauge "
        "sglang:nixl_kv_quarantined_slots) and in /server_info; above 4,096 rooms an ERROR, "
        "never an early free. A prefill writes only under a lease: each heartbeat reply grants "
        "2 s from its ping's send time; the transfer worker posts a chunk only with 0.5 s of "
        "lease left on every decode of the room, else pings and waits (at most 5 s, then the "
        "room fails) and reads the room's status again; a decode frees a dead prefill's slots "
        "no sooner than 2 s after its last reply and sends no reply while it fails that "
        "prefill's rooms, so a renewed lease comes after their failure notices."
    ),
    upstream=(
        "not upstream; PR #30352 (ABORT handled in this thread) and PR #34692 (bootstrap "
        "timeout) are; PR #35281's loop guards were dropped in review"
    ),
    remove_when=(
        "upstream's NIXL control threads isolate each message, fail waiting rooms when a thread "
        "dies, restart it, never block on a peer, bound their per-room tables, and a decode "
        "holds a failed room's KV slots until its prefill acks the abort or is declared dead "
        "and a prefill that was stopped or cut off cannot write before it reads its rooms' "
        "failures."
    ),
    tests=(
        "test/behaviour/test_nixl_bootstrap.py",
        "test/behaviour/test_pd_fail_fast.py",
        "test/behaviour/test_pd_two_process.py",
        "test/behaviour/test_pd_bounded.py",
        "test/behaviour/test_pd_quarantine.py",
    ),
    targets=(
        f"{_MANAGER}._start_bootstrap_thread",
        f"{_MANAGER}._start_decode_listener_thread",
        f"{_MANAGER}._handle_node_failure",
        f"{_MANAGER}.update_status",
        f"{_MANAGER}._send_multipart_locked",
        f"{_DECODE_QUEUE}._defer_release",
    ),
    replaces=(
        Replace(f"{_MANAGER}._start_bootstrap_thread", _start_bootstrap_thread, "(self)"),
        Replace(
            f"{_MANAGER}._start_decode_listener_thread", _start_decode_listener_thread, "(self)"
        ),
        Replace(f"{_DECODE_QUEUE}._defer_release", _defer_release, "(self, decode_req)"),
    ),
    adds=(
        Add(_CONN, _describe_nixl_control_message),
        Add(_CONN, _decode_endpoint_of_message),
        Add(_MANAGER, _pd_control),
        Add(_MANAGER, _start_control_thread),
        Add(_MANAGER, _control_thread_event_counter),
        Add(_MANAGER, _count_control_thread_event),
        Add(_MANAGER, _run_control_thread),
        Add(_MANAGER, _supervise_control_thread),
        Add(_MANAGER, _control_thread_state),
        Add(_MANAGER, control_thread_health),
        Add(_MANAGER, control_table_sizes),
        Add(_MANAGER, _rebind_control_socket),
        Add(_MANAGER, _serve_control_messages),
        Add(_MANAGER, _drop_control_message),
        Add(_MANAGER, _send_multipart_locked),
        Add(_MANAGER, _peer_socket),
        Add(_MANAGER, _drop_peer_endpoint),
        Add(_MANAGER, _close_peer_socket),
        Add(_MANAGER, _readmit_peer_endpoint),
        Add(_MANAGER, _fail_live_room),
        Add(_MANAGER, _refuse_room),
        Add(_MANAGER, _remember_concluded_room),
        Add(_MANAGER, _recall_concluded_room),
        Add(_MANAGER, update_status),
        Add(_MANAGER, _on_room_opened),
        Add(_MANAGER, _on_room_failed),
        Add(_MANAGER, _record_failed_registration),
        Add(_MANAGER, _transfer_info_refusal),
        Add(_MANAGER, _park_transfer_info),
        Add(_MANAGER, _expire_parked_transfer_infos),
        Add(_MANAGER, _answer_parked_room),
        Add(_MANAGER, _room_status_snapshot),
        Add(_MANAGER, _fail_rooms_awaiting_bootstrap),
        Add(_MANAGER, _fail_rooms_awaiting_prefill),
        Add(_MANAGER, _handle_prefill_control_message),
        Add(_MANAGER, _register_decode_peer),
        Add(_MANAGER, _store_transfer_info),
        Add(_MANAGER, _handle_decode_control_message),
        Add(_MANAGER, _handle_node_failure),
        Add(_MANAGER, _probe_decode_peers),
        Add(_MANAGER, _on_decode_pong),
        Add(_MANAGER, _on_decode_lost),
        Add(_MANAGER, _on_decode_room_failed),
        Add(_MANAGER, _prefill_endpoints_of_address),
        Add(_MANAGER, _tell_prefill_room_failed),
        Add(_MANAGER, quarantine_room),
        Add(_MANAGER, is_abort_release_safe),
        Add(_MANAGER, clear_deferred_abort_state),
        Add(_MANAGER, _note_prefill_dead),
        Add(_MANAGER, _quarantined_slots_gauge),
        Add(_MANAGER, _publish_quarantined_slots),
        Add(_MANAGER, _fail_lost_prefill),
        Add(_MANAGER, _ping_decode),
        Add(_MANAGER, _renew_decode_lease),
        Add(_MANAGER, _decode_lease_left),
        Add(_MANAGER, _await_decode_lease),
        Add(_MANAGER, _answer_prefill_ping),
        Add(_MANAGER, _granted_lease_end),
    ),
    imports={
        _CONN: (
            "import errno",
            "import zmq",
            "from collections import OrderedDict",
            "from types import SimpleNamespace",
            "from sglang.srt.utils.network import NetworkAddress, config_socket",
        )
    },
)
