"""HiCache host-mirror checks: a digest per page as it leaves the device for the host mirror, and
the same digest of what arrived in the device page when it is loaded back (`hicache_checksum`).

Hooked on upstream's DeepSeekV4PagedHostPool (every DeepSeek-V4 paged region HiCache mirrors:
c4 KV, c4 index-K, the c4 rope sibling, c128 KV, SWA):

  - backup_from_device_all_layer (after): the device pages just copied out are digested, per
    layer, into the mirror's table at their host page (digest.row_digests, the PD construction,
    over the item bytes the copy moves). A token-granular backup (not whole pages) writes part
    of a host page: that page's digest is dropped (unchecked, never falsely reported).
  - load_to_device_per_layer (after): the device pages just loaded are digested again and
    compared with their host pages' digests. The comparison stays on the device until the
    mirror's last layer is loaded (or the next backup, free or clear of any mirror), then one
    host sync reads it; each differing (layer, page) is one violation naming the region, the
    model layer (the local layer for a region not paged by the full page id), the device page
    and the host page.
  - free (after), and LogicalHostPool.free (after): host pages leaving the mirror drop their
    digests, so a page reused for a storage prefetch is never compared with an old digest. The
    c4 / c128 mirrors take their host indices from the group's logical anchor and are freed
    there (upstream's HostPoolGroup releases derived transfers once, through the anchor), so an
    anchor free drops those pages in every mirror of its page size. clear (after): every digest
    of the mirror (HostPoolGroup.clear clears each mirror).

The table: per mirror, one int64 per (layer, host page) on the mirror's device and one flag per
host page on the host, allocated when the mirror first backs up: a fixed bound of 8 B per host
page row of item_bytes (8,448 B or more for DeepSeek-V4 regions: under 0.1 % of the mirror).

Attribution: at the load no request holds the pages yet. A changed page of a region paged by the
full page id (c4 KV, c4 index-K, c128 KV) stays marked until the allocator frees it; with
ACTION=abort every request whose forward (or request row) holds it is failed with the load's
violation (a radix prefix keeps a wrong page for each request that reuses it). A changed SWA or
rope page is logged and counted only. Upstream's DeepSeekV4StateHostPool (compress state) is not
checked.

What it sees: the bytes a load puts in a device page differ from what left the device into that
host page (a copy reading another host row, layer or offset; a byte changed in the mirror while
the page sat there). What it cannot see: a tree handing a load another host page than its node
was backed up into, when that page holds a consistent backup of other tokens (the digests follow
the host page, not the tokens); token-granular transfers (their pages' digests are dropped).

Ordering on a GPU: the digests run on the stream the transfer runs on (HiCache's device-to-host
or host-to-device stream), after its copy, so they see what the copy read or wrote; a host page
is loaded only once its backup's finish event is done, which its digests precede. A load's
comparison is read back after an event recorded behind it on the transfer's stream. Which host
pages have a digest is kept on the host, in the order the hooks run. Cost: one digest pass over
the pages moved, on each side; per backup one copy of the host indices back to the host, and per
load one wait for its comparison (both end the transfer's overlap with the forward on that step;
not yet measured on a GPU).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F

from sglang_dsv4.sanitizer.digest import page_buffer_table, row_digests
from sglang_dsv4.sanitizer.ledger import Violation

logger = logging.getLogger("sglang_dsv4.sanitizer")

_U64 = (1 << 64) - 1  # digests are printed as the unsigned 64-bit sums they are
_FLUSH_AT = 64  # pending per-layer load comparisons read back at once at the latest


class _MirrorTable:
    """One host mirror's digests: [layers, host pages] and which host pages have one."""

    def __init__(self, host_pool, kvcache):
        device = host_pool.device_buffers[0].device
        self.digests = torch.zeros(
            (host_pool.layer_num, host_pool.num_host_pages), dtype=torch.int64, device=device
        )
        # On the host, updated by the hooks in program order (a free must never be overtaken
        # on some stream by a later load's read of it).
        self.known = torch.zeros(host_pool.num_host_pages, dtype=torch.bool)
        self.name = str(host_pool.pool_name)
        self.slot_page_size = host_pool.slot_page_size
        # local layer -> (region name, model layer) for buffers paged by the full page id
        by_ptr = {buf.data_ptr(): (name, layer) for name, layer, buf in page_buffer_table(kvcache)}
        self.full_page = [by_ptr.get(buf.data_ptr()) for buf in host_pool.device_buffers]


def _page_rows(host_pool, indices) -> torch.Tensor | None:
    """Page rows of whole-page transfer indices (upstream's _to_page_indices); None when the
    transfer is token-granular."""
    if indices is None or indices.numel() % host_pool.slot_page_size:
        return None
    return host_pool._to_page_indices(indices).to(torch.int64)


def _done_marker(device: torch.device):
    """An event on the current stream (the transfer's), so a read-back from another thread or
    stream waits for the comparison; None off CUDA (host ops are done when they return)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _digest_rows(buffer: torch.Tensor, rows: torch.Tensor, item_bytes: int) -> torch.Tensor:
    """Digests of the item bytes a page-row copy moves for each of `rows` of a device buffer."""
    flat = buffer.view(torch.uint8).reshape(buffer.shape[0], -1)
    picked = flat.index_select(0, rows.to(flat.device))[:, :item_bytes]
    if item_bytes % 4:
        picked = F.pad(picked, (0, 4 - item_bytes % 4))
    return row_digests(picked)


class HostMirrorChecks:
    """The HiCache half of Sanitizer (which provides report(), abort() and the PD pool)."""

    def _init_host_mirror(self) -> None:
        self.mirrors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host pool ->
        self.pending_loads: list[tuple] = []  # per-layer comparisons not read back yet
        self.tainted: dict[int, Violation] = {}  # full page -> the load that changed it

    def _mirror(self, host_pool, create: bool = False) -> _MirrorTable | None:
        table = self.mirrors.get(host_pool)
        if table is None and create and host_pool.layer_num and host_pool.num_host_pages:
            table = self.mirrors[host_pool] = _MirrorTable(host_pool, self._pd_pool())
        return table

    def on_host_backup(self, host_pool, host_indices, device_indices) -> None:
        """Device pages copied to the mirror: digest what left each device page, per layer."""
        self.flush_host_loads()
        if host_indices is None or device_indices is None or host_indices.numel() == 0:
            return
        table = self._mirror(host_pool, create=True)
        if table is None:
            return
        host_rows = _page_rows(host_pool, host_indices)
        device_rows = _page_rows(host_pool, device_indices)
        if host_rows is None or device_rows is None:  # token-granular: part of a host page
            touched = host_indices.to("cpu", torch.int64) // host_pool.slot_page_size
            table.known[torch.unique(touched)] = False
            return
        at = host_rows.to(table.digests.device)
        for layer, buffer in enumerate(host_pool.device_buffers):
            table.digests[layer, at] = _digest_rows(buffer, device_rows, host_pool.item_bytes).to(
                table.digests.device
            )
        table.known[host_rows.cpu()] = True  # indices on a GPU: one copy back of them
        self.checked["hicache_pages_digested"] += len(host_rows)

    def on_host_load(self, host_pool, host_indices, device_indices, layer: int) -> None:
        """Host pages loaded into device pages for one layer: digest what arrived and compare
        (read back at the mirror's last layer)."""
        table = self._mirror(host_pool)
        if table is None or host_indices is None or device_indices is None:
            return
        host_rows = _page_rows(host_pool, host_indices)
        device_rows = _page_rows(host_pool, device_indices)
        if host_rows is None or device_rows is None or host_rows.numel() == 0:
            return  # token-granular loads are not checked
        at = host_rows.to(table.digests.device)
        expected = table.digests[layer, at]
        actual = _digest_rows(host_pool.device_buffers[layer], device_rows, host_pool.item_bytes)
        actual = actual.to(expected.device)
        differs = actual != expected
        done = _done_marker(differs.device)
        self.pending_loads.append(
            (table, layer, host_rows, device_rows, differs, expected, actual, done)
        )
        if layer == host_pool.layer_num - 1 or len(self.pending_loads) >= _FLUSH_AT:
            self.flush_host_loads()

    def flush_host_loads(self) -> int:
        """Read back the pending load comparisons; one violation per changed (layer, page)."""
        pending, self.pending_loads = self.pending_loads, []
        if not pending:
            return 0
        for *_, done in pending:
            if done is not None:
                done.synchronize()
        flags = torch.cat([p[4] for p in pending]).cpu()
        before = len(self.violations)
        at = 0
        for table, layer, host_rows, device_rows, differs, expected, actual, _ in pending:
            n = len(differs)
            host_rows = host_rows.cpu()
            # Whether each host page had a digest: as at the load, since every backup, free
            # and clear reads the pending loads back before it changes a digest.
            known = table.known[host_rows]
            self.checked["hicache_pages_checked"] += int(known.sum())
            hits = (flags[at : at + n] & known).nonzero().flatten().tolist()
            at += n
            if not hits:
                continue
            host_rows, device_rows = host_rows.tolist(), device_rows.tolist()
            expected, actual = expected.cpu(), actual.cpu()
            region = table.full_page[layer]
            name, model_layer = region if region is not None else (table.name, None)
            for i in hits:
                page = device_rows[i]
                if region is None:
                    where = f"{table.name} layer {layer}"
                else:
                    where = f"{name} ({table.name}) model layer {model_layer}"
                violation = Violation(
                    "hicache_checksum",
                    layer=model_layer if region is not None else layer,
                    page=page,
                    expected=f"{where} host page {host_rows[i]}: digest "
                    f"{int(expected[i]) & _U64:#018x} taken at its backup",
                    found=f"device page {page} after the load: digest "
                    f"{int(actual[i]) & _U64:#018x}",
                )
                self.report(violation)
                if region is not None:
                    self.tainted.setdefault(page, violation)
        return len(self.violations) - before

    def on_host_free(self, host_pool, indices) -> None:
        """Host pages leaving the mirror drop their digests."""
        self.flush_host_loads()
        table = self._mirror(host_pool)
        if table is None or indices is None or indices.numel() == 0:
            return
        rows = torch.unique(indices.to("cpu", torch.int64) // host_pool.slot_page_size)
        table.known[rows[rows < len(table.known)]] = False

    def on_anchor_free(self, anchor, indices) -> None:
        """Host pages freed in the logical anchor (LogicalHostPool): the c4 / c128 mirrors take
        their host indices from it and are never freed themselves, so every mirror of its page
        size drops those pages' digests (one in another index space only loses a check)."""
        self.flush_host_loads()
        if indices is None or len(indices) == 0:
            return
        rows = torch.unique(indices.to("cpu", torch.int64) // anchor.page_size)
        for table in list(self.mirrors.values()):
            if table.slot_page_size == anchor.page_size:
                table.known[rows[rows < len(table.known)]] = False

    def on_host_clear(self, host_pool) -> None:
        self.flush_host_loads()
        table = self._mirror(host_pool)
        if table is not None:
            table.known.zero_()

    # --- attribution ---------------------------------------------------------------------------

    def attribute_load(self, row: int, pages) -> None:
        """A request row holds `pages`: with ACTION=abort, a page a load changed fails it."""
        if not self.tainted or self.action != "abort":
            return
        for page in pages:
            violation = self.tainted.get(page)
            if violation is not None:
                self.abort(row, violation)

    def untaint(self, pages) -> None:
        for page in pages:
            self.tainted.pop(page, None)
