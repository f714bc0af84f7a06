"""HiCache start-up refuses a DeepSeek-V4 pool whose getters read a layer before it landed.

Contract (index-k-transfer-gate): when HiCache installs its layer counter
(register_layer_transfer_counter), every get_* method of the pool's class that takes an argument
is called with a layer id first (whatever the parameter is named) on one layer of each kind
(sliding, c4, c128, low ratio), twice, with different bytes in the index-K and compress-state
memory before each call and a counter whose wait overwrites that memory with one sentinel, as a
finished host -> device load does. A getter that waits before it reads returns the same thing
both times; one that read first (a copy, a value computed from it, or a view with no wait at all)
does not, and the pool refuses the counter with one line naming it.

Real upstream pools (device="cpu") built by upstream's sizing chain: fp8 and bf16 index keys on
DeepSeek-V4-Flash, and a low-ratio pool from a DeepSeek-V4.1-style config (ratio-1 and ratio-2
kv_source layers, upstream's forced-fp4 low-ratio indexer pools). Stand-in: the HiCache counter
object (`Counter`), whose real wait blocks on CUDA events of a running load.
"""

from __future__ import annotations

import json

import pytest
import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from support.dsv4 import default_model_dir, small_pool


class Counter:
    """Stand-in for HiCache's LayerDoneCounter; HiCache only hands it over here."""

    def wait_until(self, layer: int) -> None:
        pass


def low_ratio_model(folder) -> str:
    """DeepSeek-V4-Flash's config with layers 4 and 6 turned into ratio-2 and ratio-1
    kv_source layers, as DeepSeek-V4.1 configs declare them."""
    config = json.loads((default_model_dir() / "config.json").read_text())
    config["model_type"] = "deepseek_v41"
    config["compress_ratios"][4], config["compress_ratios"][6] = 2, 1
    config["kv_source_layer_ids"] = [4, 6]
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module", params=["fp8", "bf16", "low-ratio"])
def pool(request, tmp_path_factory):
    if request.param == "low-ratio":
        model = low_ratio_model(tmp_path_factory.mktemp("dsv41"))
        _, pool = small_pool("fp8", model_path=model)
        assert {1, 2, 4} <= set(pool.index_pools)
        return pool
    _, pool = small_pool(request.param)
    assert pool.c4_indexer_kv_pool.index_k_dtype == request.param
    return pool


def index_rows(pool, layer_id) -> torch.Tensor:
    """The layer's index-K page rows (KeyError on a layer without an indexer)."""
    item = pool.layer_mapping[layer_id]
    return pool.index_pools[item.compress_ratio].index_k_with_scale_buffer[item.compress_layer_id]


def refusal(pool, cls) -> str:
    """The line HiCache start-up stops with when the pool is of class `cls`."""
    pool.__class__ = cls
    try:
        with pytest.raises(RuntimeError) as refused:
            pool.register_layer_transfer_counter(Counter())
    finally:
        pool.__class__ = DeepSeekV4TokenToKVPool
    assert pool.layer_transfer_counter is None
    return str(refused.value)


def test_upstream_getters_pass_on_every_layer_kind_and_memory_is_restored(pool):
    generator = torch.Generator().manual_seed(3)
    rows = [r for p in pool.index_pools.values() for r in p.index_k_with_scale_buffer]
    for r in rows:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=generator))
    before = [r.clone() for r in rows]

    counter = Counter()
    pool.register_layer_transfer_counter(counter)
    assert pool.layer_transfer_counter is counter
    pool.register_layer_transfer_counter(None)
    assert all(torch.equal(r, b) for r, b in zip(rows, before, strict=True))


class CopiesRowsBeforeWaiting(DeepSeekV4TokenToKVPool):
    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        rows = index_rows(self, layer_id).clone()
        self.wait_layer_transfer(layer_id)
        return rows


class WaitsOnlyForC4Layers(DeepSeekV4TokenToKVPool):
    def get_attention_compress_states(self, layer_id: int):
        if self.layer_mapping[layer_id].compress_ratio == 4:
            self.wait_layer_transfer(layer_id)
        return self.compress_state_pools[layer_id]


class ParameterNotNamedLayerId(DeepSeekV4TokenToKVPool):
    def get_index_k_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        rows = index_rows(self, layer)[0].clone()
        self.wait_layer_transfer(layer)
        return rows


class NameSaysNothingOfIndexK(DeepSeekV4TokenToKVPool):
    def get_rows(self, layer_id: int) -> torch.Tensor:
        return index_rows(self, layer_id)  # a view, and no wait


@pytest.mark.parametrize(
    "cls, getter, kind",
    [
        (CopiesRowsBeforeWaiting, "get_index_k_with_scale_buffer", "c4"),
        (WaitsOnlyForC4Layers, "get_attention_compress_states", "c128"),
        (ParameterNotNamedLayerId, "get_index_k_rows", "c4"),
        (NameSaysNothingOfIndexK, "get_rows", "c4"),
    ],
)
def test_hicache_start_up_refuses_a_getter_that_reads_before_waiting(pool, cls, getter, kind):
    line = refusal(pool, cls)
    assert "\n" not in line
    assert f"{getter} ({kind} layer " in line
    assert "read before the layer's transfer landed" in line


class SkipsTheWaitOnLowRatioLayers(DeepSeekV4TokenToKVPool):
    def get_low_ratio_index_k_rows(self, layer_id: int) -> torch.Tensor:
        if self.layer_mapping[layer_id].compress_ratio not in (1, 2):
            self.wait_layer_transfer(layer_id)
        return index_rows(self, layer_id)[0].clone()


def test_low_ratio_layers_are_probed_too(pool):
    if 2 not in pool.index_pools:
        pytest.skip("DeepSeek-V4-Flash has no low-ratio layers")
    assert "get_low_ratio_index_k_rows (low-ratio c2 layer 4:" in refusal(
        pool, SkipsTheWaitOnLowRatioLayers
    )


class WaitsForAnotherLayer(DeepSeekV4TokenToKVPool):
    def get_index_k_of_next_layer(self, layer_id: int) -> torch.Tensor:
        self.wait_layer_transfer(layer_id + 1)
        return index_rows(self, layer_id)


class TakesAnUnknownArgument(DeepSeekV4TokenToKVPool):
    def get_index_k_window(self, layer_id: int, window: int) -> torch.Tensor:
        self.wait_layer_transfer(layer_id)
        return index_rows(self, layer_id)[:window]


def test_a_wait_for_another_layer_or_an_unprobeable_getter_is_refused(pool):
    assert "get_index_k_of_next_layer (c4 layer" in refusal(pool, WaitsForAnotherLayer)
    line = refusal(pool, TakesAnUnknownArgument)
    assert "get_index_k_window (takes 'window', for which the probe has no value" in line


class ViewThenWait(DeepSeekV4TokenToKVPool):
    def get_rows_view(self, layer: int) -> torch.Tensor:
        rows = index_rows(self, layer)  # a view: read by the caller, after the wait below
        self.wait_layer_transfer(layer)
        return rows


def test_a_view_taken_before_the_wait_is_not_a_read(pool):
    counter = Counter()
    pool.__class__ = ViewThenWait
    try:
        pool.register_layer_transfer_counter(counter)
        assert pool.layer_transfer_counter is counter
    finally:
        pool.register_layer_transfer_counter(None)
        pool.__class__ = DeepSeekV4TokenToKVPool
