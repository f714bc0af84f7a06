"""The CPU backend's HiCache (cpu_backend/hicache_hooks.py): upstream's DeepSeek-V4 host pools built
on the CPU and their pages moved by the torch movers, in every host layout and io backend the
pools take, byte for byte.

Real upstream code: the DeepSeek-V4 token-to-KV pool (device="cpu", built by upstream's sizing
chain), hybrid_pool_assembler._dsv4_indexer_regions, DeepSeekV4PagedHostPool with its own
backup_from_device_all_layer / load_to_device_per_layer, and its allocation through upstream's
ALLOC_MEMORY_FUNCS. The hooks are set with monkeypatch (undone after each test) rather than
through the plugin, which would leave them in this process; a separate process checks that a
--device cpu scheduler gets them from the plugin.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from sglang.srt.mem_cache import memory_pool_host
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
from sglang.srt.mem_cache.pool_host import common
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang_dsv4 import cpu_backend, warm_python
from sglang_dsv4.cpu_backend import hicache_hooks
from support.dsv4 import small_pool

PAGE = 256
NUM_HOST_PAGES = 6
# (host layout, io backend): the pairs upstream's DeepSeek-V4 paged host pool moves pages for
# (kernel_ascend is Ascend's own op).
LAYOUTS = [
    ("layer_first", "kernel"),
    ("layer_first", "direct"),
    ("page_first", "kernel"),
    ("page_first_direct", "direct"),
]


@pytest.fixture(scope="module")
def device_pool():
    return small_pool("bf16")[1]


def with_cpu_hicache(monkeypatch) -> None:
    monkeypatch.setattr(common, "alloc_with_host_register", hicache_hooks.alloc_with_host_register)
    # ALLOC_MEMORY_FUNCS is a defaultdict: its first lookup for "cpu" (an earlier test) kept
    # upstream's function. In a server the hook is in before any lookup (the subprocess test).
    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", hicache_hooks.alloc_with_host_register)
    for mover in hicache_hooks.MOVERS:
        monkeypatch.setattr(memory_pool_host, mover.__name__, mover, raising=False)


def mirror(region, layout: str, pin_memory: bool = True) -> DeepSeekV4PagedHostPool:
    # Booked against upstream's budget scope (1 GiB; it needs a few MiB): outside one, upstream
    # checks free memory less a 10 GiB reserve, which a busy machine does not always have.
    with host_memory_budget_scope(1 << 30):
        return DeepSeekV4PagedHostPool(
            pool_name=str(region.name), device_buffers=region.device_buffers,
            item_bytes=region.item_bytes, num_host_pages=NUM_HOST_PAGES,
            slot_page_size=region.slot_page_size, layout=layout, device="cpu",
            pin_memory=pin_memory, page_aligned_only=region.page_aligned_only,
        )


def host_layer(host: DeepSeekV4PagedHostPool, layer: int) -> torch.Tensor:
    """Layer `layer` of the host mirror, a row of bytes per host page, whatever the layout."""
    if host.layout == "layer_first":
        return host.kv_buffer[layer]
    if host.layout == "page_first":
        return host.kv_buffer[:, layer]
    return host.kv_buffer[:, layer, 0]


def test_without_the_hooks_upstream_cannot_pin_or_move_a_host_page(device_pool):
    """Why the hooks exist: a pinned host pool needs cudaHostRegister, and the movers are not
    even imported off CUDA."""
    (region,) = _dsv4_indexer_regions(device_pool, PAGE)
    with pytest.raises((RuntimeError, AssertionError, OSError, AttributeError)):
        mirror(region, "layer_first", pin_memory=True)
    host = mirror(region, "layer_first", pin_memory=False)
    pages = torch.arange(2 * PAGE, 3 * PAGE)
    with pytest.raises(NameError, match="transfer_kv_all_layer_mla"):
        host.backup_from_device_all_layer(
            device_pool.c4_indexer_kv_pool, host.alloc(PAGE), pages, "kernel")


@pytest.mark.parametrize("layout, io_backend", LAYOUTS)
def test_pages_go_to_the_host_and_come_back_byte_for_byte(device_pool, monkeypatch, layout,
                                                          io_backend):
    with_cpu_hicache(monkeypatch)
    (region,) = _dsv4_indexer_regions(device_pool, PAGE)
    host = mirror(region, layout)  # pin_memory=True, as HiCache builds it
    layers = region.device_buffers
    generator = torch.Generator().manual_seed(11)
    for rows in layers:
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator))
    written = [rows.clone() for rows in layers]

    # Device pages 3 and 1 (out of order) to host pages taken from the pool's free list.
    device_indices = torch.cat([torch.arange(3 * PAGE, 4 * PAGE), torch.arange(PAGE, 2 * PAGE)])
    host.alloc(PAGE)  # host page 0 stays unused: the copy must go to the pages it was given
    host_indices = host.alloc(2 * PAGE)
    host.backup_from_device_all_layer(device_pool.c4_indexer_kv_pool, host_indices,
                                      device_indices, io_backend)
    host_rows = host_indices.reshape(-1, PAGE)[:, 0] // PAGE
    for layer in range(len(layers)):
        backed = host_layer(host, layer)
        assert torch.equal(backed[host_rows[0]], written[layer][3].view(-1).view(torch.uint8))
        assert torch.equal(backed[host_rows[1]], written[layer][1].view(-1).view(torch.uint8))
        assert not backed[0].any(), "a host page that was not given was written"

    # Evicted on the device (another request's bytes there), then loaded back layer by layer
    # into other device pages, 0 and 2.
    for rows in layers:
        rows.fill_(0xAB)
    into = torch.cat([torch.arange(0, PAGE), torch.arange(2 * PAGE, 3 * PAGE)])
    for layer in range(len(layers)):
        host.load_to_device_per_layer(device_pool.c4_indexer_kv_pool, host_indices, into, layer,
                                      io_backend)
        rows = layers[layer]
        assert torch.equal(rows[0], written[layer][3]) and torch.equal(rows[2], written[layer][1])
        assert bool((rows[1] == 0xAB).all() and (rows[3:] == 0xAB).all()), "other pages written"
        for later in layers[layer + 1:]:
            assert bool((later == 0xAB).all()), "a load of one layer wrote another"


def test_pointer_table_movers_reach_only_the_rows_indexed():
    """The kernel movers take layers as tables of raw addresses, as the CUDA kernels do."""
    item = 48
    src = [torch.randint(0, 256, (5, item), dtype=torch.uint8) for _ in range(2)]
    dst = [torch.zeros((7, item), dtype=torch.uint8) for _ in range(2)]
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    hicache_hooks.transfer_kv_all_layer_mla(table(src), table(dst), torch.tensor([4, 0]),
                                            torch.tensor([6, 2]), item, 2)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[6], s[4]) and torch.equal(d[2], s[0])
        assert not d[[0, 1, 3, 4, 5]].any()
    with pytest.raises(ValueError, match="not contiguous"):
        hicache_hooks.transfer_kv_per_layer_mla(src[0].t(), dst[0], torch.tensor([0]),
                                                torch.tensor([0]), item)


# A --device cpu scheduler: the plugin loaded as upstream's server loads it, the host pool
# module imported (which installs the hooks), a pinned host pool built and a page moved.
SERVER_PROCESS = """
import json, sys
sys.argv = ["sglang.launch_server", "--model-path", {model!r}, "--device", "cpu"]
sys.path.insert(0, {test_dir!r})
from sglang.srt.plugins import load_plugins
load_plugins()
import torch
import sglang.srt.mem_cache.memory_pool_host as host_module
from sglang_dsv4 import plugin
plugin.settle()
from test_cpu_hicache import mirror, PAGE
from support.dsv4 import small_pool
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions
pool = small_pool("bf16")[1]
(region,) = _dsv4_indexer_regions(pool, PAGE)
region.device_buffers[0][1].fill_(7)
host = mirror(region, "layer_first")
host.backup_from_device_all_layer(pool.c4_indexer_kv_pool, host.alloc(PAGE),
                                  torch.arange(PAGE, 2 * PAGE), "kernel")
print(json.dumps({{"status": plugin.STATE["cpu-backend-hicache"].status,
                   "moved": int(host.kv_buffer[0][0].sum() == 7 * region.item_bytes)}}))
"""


@pytest.mark.slow
def test_a_cpu_server_installs_the_hooks_through_upstreams_registry(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    from pathlib import Path

    script = SERVER_PROCESS.format(model=str(tmp_path), test_dir=str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if k != cpu_backend.ENV}
    proc = warm_python.run(["-c", textwrap.dedent(script)], env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"status": "applied", "moved": 1}


def test_the_host_reserve_is_a_cpu_servers_not_a_gpu_servers(monkeypatch):
    from sglang.srt.mem_cache.pool_host import base

    free = 6 << 30  # a busy development machine
    monkeypatch.setattr(base, "available_host_memory_bytes", lambda **_: free)
    monkeypatch.setattr(base, "ranks_per_host", lambda: 1)
    assert base.host_memory_budget_bytes() == free - (10 << 30)  # upstream: less than nothing
    assert hicache_hooks.host_memory_budget_bytes() == free - hicache_hooks.CPU_RESERVE_BYTES
    # Inside upstream's booking scope its snapshot stands, as upstream books it.
    with host_memory_budget_scope(1 << 20):
        assert hicache_hooks.host_memory_budget_bytes(4096) == 1 << 20
        assert hicache_hooks.host_memory_budget_bytes() == (1 << 20) - 4096
