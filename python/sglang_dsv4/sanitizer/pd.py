"""PD transfer checks (NIXL): a prefill digests each chunk's pages as it is queued and sends the
room's digests on its Success status; the decode digests the room's own pages again when that
status arrives, before the room can read Success, and compares (one `pd_checksum` per changed
page). A decode room that fails is watched past its end: once its pages are freed (and poisoned)
nothing may write them until they are handed out again, and a byte that changed meanwhile (a
prefill that transferred into slots its decode gave up) is `late_write`. See digest.py for the
digest and the frames."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict

import numpy as np
import torch

from sglang_dsv4.sanitizer.digest import (
    STATE_TAG,
    decode_frames,
    decode_state_frames,
    encode_frames,
    encode_state_frames,
    page_buffer_table,
    page_buffers,
    page_checksums,
    poison_buffers,
    state_checksums,
)
from sglang_dsv4.sanitizer.ledger import POISON_BYTE, Violation

logger = logging.getLogger("sglang_dsv4.sanitizer")

_KEEP_ROOMS = 1024  # rooms whose digests / pages are kept (a room cleared unconcluded ages out)
_WATCH_PAGES = 8192  # freed pages of failed rooms watched for a late write (the oldest go first)


class TransferChecks:
    """The PD half of Sanitizer (which provides report() and violations)."""

    def _init_transfer(self) -> None:
        self.pd_pool = None  # weakref to this process's DeepSeekV4TokenToKVPool
        self.sent_digests: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()  # prefill
        self.room_pages: OrderedDict[int, np.ndarray] = OrderedDict()  # decode: room -> pages
        self.sent_states: OrderedDict[int, list] = OrderedDict()  # prefill: room -> digests
        self.room_states: OrderedDict[int, list] = OrderedDict()  # decode: room -> state items
        # decode: a failed room -> its pages not freed yet; a freed page of one -> its room
        self.failed_rooms: OrderedDict[int, set[int]] = OrderedDict()
        self.late_watch: OrderedDict[int, int] = OrderedDict()

    def verify_page_checksums(
        self, pool, pages, expected: torch.Tensor, request: str | None = None
    ) -> int:
        """Compare decode-side digests with the prefill side's; one violation per changed page."""
        actual = page_checksums(pool, pages)
        before = len(self.violations)
        table = page_buffer_table(pool)
        bad = (actual != expected.to(actual.device)).nonzero().tolist()
        pages = torch.as_tensor(pages).reshape(-1).tolist()
        for buffer_i, page_i in bad:
            self.report(
                Violation(
                    "pd_checksum",
                    request=request,
                    layer=table[buffer_i][1],
                    page=pages[page_i],
                    expected=f"{table[buffer_i][0]} digest {int(expected[buffer_i, page_i]):#x}",
                    found=f"{int(actual[buffer_i, page_i]):#x}",
                ),
            )
        return len(self.violations) - before

    def watch_pool(self, pool) -> None:
        self.pd_pool = weakref.ref(pool)

    def _pd_pool(self):
        return self.pd_pool() if self.pd_pool is not None else None

    @staticmethod
    def _remember(table: OrderedDict, key, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _KEEP_ROOMS:
            table.popitem(last=False)

    def on_chunk_queued(self, room: int, pages, index_slice: slice, state_indices=None) -> None:
        """Prefill: digest a chunk's pages as it is queued for transfer, keyed by their position
        in the room's page list (the decode's pages at the same positions receive them), and the
        state items it sends (the last chunk), by component and position."""
        pool = self._pd_pool()
        if pool is None:
            return
        if state_indices is not None and any(s is not None and len(s) for s in state_indices):
            self._remember(self.sent_states, room, state_checksums(pool, state_indices))
        if pages is None or len(pages) == 0:
            return
        start = index_slice.start or 0
        chunks = {} if start == 0 else self.sent_digests.get(room, {})
        chunks[start] = page_checksums(pool, np.asarray(pages, dtype=np.int64))
        self._remember(self.sent_digests, room, chunks)

    def digest_frames(self, room: int) -> list[bytes]:
        """Prefill: the frames appended to the room's Success status (none when nothing was
        digested): tag, "buffers,pages", int32 positions, int64 digests [buffers, pages]. The
        room's digests are dropped once framed."""
        chunks = self.sent_digests.pop(room, None)
        states = self.sent_states.pop(room, None)
        if not chunks:
            return []
        return encode_frames(chunks) + (encode_state_frames(states) if states else [])

    def on_receiver_pages(self, room: int, pages, state_indices=None) -> None:
        """Decode: the pages a room's KV lands in, in the order the prefill addresses them, and
        the state items it receives (per component, in the prefill's order)."""
        if pages is not None:
            self._remember(self.room_pages, room, np.asarray(pages, dtype=np.int64).copy())
        if state_indices is not None:
            items = [None if s is None else list(s) for s in state_indices]
            self._remember(self.room_states, room, items)

    def verify_state_checksums(self, pool, state_indices, expected, request=None) -> int:
        """Compare the decode's state items with the prefill's digests; one violation per changed
        (component, buffer, item)."""
        actual = state_checksums(pool, state_indices)
        before = len(self.violations)
        for c, (want, have) in enumerate(zip(expected, actual, strict=False)):
            if want is None or have is None or want.shape != have.shape:
                if (want is None) != (have is None) or (
                    want is not None and want.shape != have.shape
                ):
                    self.report(
                        Violation(
                            "pd_checksum",
                            request=request,
                            expected=f"state component {c} digests for the items received",
                            found="a different number of state items",
                        )
                    )
                continue
            for buffer_i, item_i in (have != want).nonzero().tolist():
                self.report(
                    Violation(
                        "pd_checksum",
                        request=request,
                        slot=int(state_indices[c][item_i]),
                        expected=f"state component {c} buffer {buffer_i} digest "
                        f"{int(want[buffer_i, item_i]):#x}",
                        found=f"{int(have[buffer_i, item_i]):#x}",
                    )
                )
        return len(self.violations) - before

    def on_room_failed(self, room: int) -> None:
        """Decode: a room this decode opened failed. Its pages may still be written by a prefill
        that has not heard (the quarantine holds them until it is safe); once they are freed,
        nothing may write them."""
        pages = self.room_pages.get(room)
        if pages is not None:
            self._remember(self.failed_rooms, room, {int(p) for p in pages if p > 0})

    def watch_freed(self, pages: list[int]) -> None:
        """Decode: pages just freed (and poisoned); those of a failed room are watched."""
        freed = set(pages)
        for room, held in list(self.failed_rooms.items()):
            watched = held & freed
            for page in watched:
                self.late_watch[page] = room
                self.late_watch.move_to_end(page)
            if watched:
                logger.info(
                    "sanitizer: %d freed pages of failed room %s watched for a late write",
                    len(watched),
                    room,
                )
            held -= freed
            if not held:
                del self.failed_rooms[room]
        while len(self.late_watch) > _WATCH_PAGES:
            self.late_watch.popitem(last=False)

    def check_late_writes(self, kvcache, handed_out: list[int]) -> int:
        """Decode, on every allocation: each watched page must still hold the poison it was
        freed with, in every buffer poisoned; a page that changed is `late_write` naming its
        room. Pages handed out now leave the watch (their new owner writes them)."""
        if not self.late_watch:
            return 0
        pages = list(self.late_watch)
        changed = torch.zeros(len(pages), dtype=torch.int64)
        for buffer in poison_buffers(kvcache):
            rows = buffer.index_select(0, torch.tensor(pages, device=buffer.device))
            changed += (rows != POISON_BYTE).sum(dim=1).cpu()
        found = 0
        for page, count in zip(pages, changed.tolist(), strict=True):
            if count:
                room = self.late_watch.pop(page)
                self.report(
                    Violation(
                        "late_write",
                        request=f"room {room}",
                        page=page,
                        expected="the poison it was freed with (its PD room failed; nothing "
                        "may write it until it is handed out again)",
                        found=f"{count} bytes written while free",
                    )
                )
                found += 1
        for page in handed_out:
            self.late_watch.pop(page, None)
        return found

    def check_arrival(self, room: int, frames: list[bytes]) -> str | None:
        """Decode, on the room's Success status: the digest frames (from PD_DIGEST_TAG on) against
        the pages as they are now. Returns the first violation's line, or None when clean."""
        pool = self._pd_pool()
        # Kept (bounded) rather than popped: each prefill rank that sends pages sends digests.
        pages = self.room_pages.get(room)
        if pool is None or pages is None:
            return None  # no DeepSeek-V4 pool here, or a room this decode did not open
        try:
            buffers, positions, expected = decode_frames(frames)
            if buffers != len(page_buffers(pool)):
                # A prefill pool of other layers (a pipeline stage): not comparable page for page.
                logger.warning(
                    "sanitizer: room %s not digest-checked: the prefill digested %d page "
                    "buffers, this decode has %d",
                    room,
                    buffers,
                    len(page_buffers(pool)),
                )
                return None
            dst_pages = pages[positions]
        except (IndexError, ValueError) as exc:
            violation = Violation(
                "pd_checksum",
                request=f"room {room}",
                expected="page digests this decode can check",
                found=f"unreadable digest frames ({exc})",
            )
            self.report(violation)
            return violation.line()
        found = self.verify_page_checksums(pool, dst_pages, expected, request=f"room {room}")
        states = self.room_states.get(room)
        if STATE_TAG in frames and states is not None:
            at = frames.index(STATE_TAG)
            try:
                sent = decode_state_frames(frames[at:])
            except (IndexError, ValueError) as exc:
                violation = Violation(
                    "pd_checksum",
                    request=f"room {room}",
                    expected="state digests this decode can check",
                    found=f"unreadable state digest frames ({exc})",
                )
                self.report(violation)
                return violation.line()
            found += self.verify_state_checksums(pool, states, sent, request=f"room {room}")
        return self.violations[-found].line() if found else None
