"""The control messages each side handles (nixl-bootstrap-cascade): the prefill's from its decode
ranks (registrations, transfer infos, aborts, staging, heartbeat replies, a decode's failed
room), the decode's from its prefill ranks (room status, staging, heartbeat pings).

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import threading

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.staging_handler import (
    handle_staging_rsp,
    handle_watermark_msg,
)
from sglang.srt.disaggregation.nixl.conn import (
    ABORT_TAG,
    GUARD,
    KVArgsRegisterInfo,
    TransferInfo,
    logger,
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
    if tag == b"PD_PONG":
        self._on_decode_pong(frames)
        return
    if tag == b"PD_ROOM_FAILED":
        self._on_decode_room_failed(frames)
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
    pd = self._pd_control()
    with pd.lock:
        cleared = pd.failed_registrations.pop(name, None)
    if cleared is not None:
        logger.info("Decode peer %s registered; its earlier failure (%s) is cleared", name, cleared)
    self._readmit_peer_endpoint(peer.endpoint, peer.dst_port)
    logger.debug("Registered KVArgs of decode peer %s", name)


def _store_transfer_info(self, info: TransferInfo) -> None:
    room = info.room
    refusal = self._transfer_info_refusal(info)
    if refusal is not None:
        # Never stored: the room must not become ready, and its decode hears why at once.
        self._refuse_room(room, refusal, (info.endpoint, info.dst_port))
        return
    pd = self._pd_control()
    if pd.dropped_endpoints:
        # A decode that sends is alive again (its link came back): send to it again.
        self._readmit_peer_endpoint(info.endpoint, info.dst_port)
    with pd.lock:
        # Checked under the lock _on_room_opened takes after the room opens: an info is either
        # parked before the room opens (and taken by it) or stored after.
        if room not in self.request_status:
            # Nothing is created for a room the prefill has not opened: upstream's tables grow
            # only with rooms that exist.
            self._park_transfer_info(info)
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
        self.req_to_decode_prefix_len[room] = next((n for n in prefix_lens if n is not None), 0)
    self.update_status(room, KVPoll.WaitingForInput)


def _handle_decode_control_message(self, frames: list[bytes]) -> None:
    """Handle one message from a prefill rank; raises if it cannot be handled."""
    if frames[0] == b"STAGING_REQ":
        if self.enable_staging:
            self._handle_staging_req(frames)
        return
    if self.handle_chunk_ready(frames) or self.handle_abort_ack_message(frames):
        return
    if frames[0] == b"PD_PING":
        self._answer_prefill_ping(frames)
        return
    parsed = self.parse_kv_status_message(frames)
    if parsed is None:
        what = "malformed" if frames[0] == self.kv_status_msg_tag else "unknown"
        raise ValueError(f"{what} message, tag {bytes(frames[0][:20])!r}")
    room, status, prefill_rank, reason = parsed
    pd = self._pd_control()
    pd.applying_prefill_status = threading.get_ident()  # its failure is not sent back
    try:
        self.apply_prefill_status(
            bootstrap_room=room,
            status=status,
            prefill_rank=prefill_rank,
            failure_reason=reason,
        )
    finally:
        pd.applying_prefill_status = None
