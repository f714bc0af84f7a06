"""Sends to peers that never block (nixl-bootstrap-cascade): the cached PUSH socket per peer, a
peer that does not drain dropped and skipped until it registers again.

Written as they stand in sglang/srt/disaggregation/nixl/conn.py (the fix adds them there).
"""

from __future__ import annotations

import threading

import zmq
from sglang.srt.disaggregation.nixl.conn import logger
from sglang.srt.utils.network import NetworkAddress


def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False):
    """Send to a peer without ever blocking the caller (a control thread, the scheduler).

    The message is queued on the peer's cached PUSH socket (at most ZMQ's send high-water mark,
    1,000 messages, per peer). A peer whose queue stays full does not drain (dead, unreachable,
    or hung): its socket is closed, it is counted and logged once, and messages to it are
    skipped (counted) until it registers again, which connects it afresh."""
    pd = self._pd_control()
    if endpoint in pd.dropped_endpoints:
        self._count_control_thread_event("peer_send", "skipped")
        return
    sock = self._peer_socket(endpoint, is_ipv6)
    with self._socket_send_locks[endpoint]:
        try:
            sock.send_multipart(parts, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
    self._drop_peer_endpoint(endpoint, "its send queue stayed full: the peer does not drain it")


def _peer_socket(self, endpoint: str, is_ipv6: bool = False, queue_bound: int = 1000):
    """The cached PUSH socket to a peer, made on first use. Unlike upstream's _connect it
    reconnects by itself (every 0.1 s, backing off to 1 s): upstream's never does
    (RECONNECT_IVL -1) and recreates a socket only on a DISCONNECTED event, which a connect
    that failed (link down: ENETUNREACH) never raises, so such a peer was never reached again.
    At most `queue_bound` messages wait per peer (ZMQ's send high-water mark)."""
    with self._socket_lock:
        sock = self._socket_cache.get(endpoint)
        if sock is not None:
            return sock
        sock = self._zmq_ctx.socket(zmq.PUSH)
        if is_ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SNDHWM, queue_bound)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        sock.connect(endpoint)
        self._socket_cache[endpoint] = sock
        self._socket_send_locks.setdefault(endpoint, threading.Lock())
        return sock


def _drop_peer_endpoint(self, endpoint: str, cause: str) -> None:
    """Close a peer's cached socket and skip sends to it until it registers again."""
    pd = self._pd_control()
    with pd.lock:
        if endpoint in pd.dropped_endpoints:
            return
        pd.dropped_endpoints[endpoint] = cause
        while len(pd.dropped_endpoints) > pd.bounds.peers:
            pd.dropped_endpoints.popitem(last=False)
    self._close_peer_socket(endpoint)
    self._count_control_thread_event("peer_send", "peer_dropped")
    logger.error(
        "NIXL peer %s dropped (%s): its socket is closed and messages to it are skipped until "
        "it registers again",
        endpoint,
        cause,
    )


def _close_peer_socket(self, endpoint: str) -> None:
    """Close the cached socket to a peer (what it queued is discarded); the next send to the
    peer connects afresh, which a connection stalled in TCP retransmission would not."""
    with self._socket_lock:
        sock = self._socket_cache.pop(endpoint, None)
        monitor = self._monitor_cache.pop(endpoint, None)
    for s in (sock, monitor):
        if s is not None:
            try:
                s.close(linger=0)
            except Exception:
                pass


def _readmit_peer_endpoint(self, ip: str, port: int) -> None:
    """A peer that registers again is sent to again, on a fresh connection."""
    endpoint = NetworkAddress(ip, port).to_tcp()
    pd = self._pd_control()
    with pd.lock:
        cause = pd.dropped_endpoints.pop(endpoint, None)
    if cause is not None:
        logger.info("NIXL peer %s registered again; sending to it again", endpoint)
