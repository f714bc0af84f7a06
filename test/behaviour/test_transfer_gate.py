"""Every index-K / compress-state read of a DeepSeek-V4 pool waits for its layer's HiCache transfer.

Contract (index-k-transfer-gate): each method of DeepSeekV4TokenToKVPool that hands out index-K
or compress-state memory for a layer calls wait_layer_transfer(layer_id) before it reads. The
methods are found on the real class by one rule, so getters added later (index-k-bf16's, or
upstream's next ones) are checked with no list to keep: public, second parameter `layer_id`, name
containing index_k / indexer / compress_state, not a setter (set_*), not annotated to return a
scalar (int, bool, str).

Real upstream pools (device="cpu") of both index-K dtypes, built by upstream's sizing chain.
Stand-in: the HiCache layer counter (`LandingCounter`). It records every wait and "lands" the
layer's host -> device transfer at that moment by writing the index-K page rows, as the real
counter releases a reader only once the copy is done; a getter that copied rows before waiting
returns the pre-transfer zeros.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from support.dsv4 import small_pool

LANDED_BYTE = 0x3C  # any non-zero byte: pools start zeroed

# Values for the getters' other parameters, by name (4 slots of page 0 of the layer).
SLOTS = torch.arange(4, dtype=torch.int64)
ARGUMENTS = {
    "slots": SLOTS,
    "loc": SLOTS,
    "page_indices": torch.zeros((1, 1), dtype=torch.int32),
    "seq_len_tensor": torch.tensor([4], dtype=torch.int32),
    "seq_len_sum": 4,
    "max_seq_len": 4,
}
UPSTREAM_GETTERS = {
    "get_index_k_with_scale_buffer",
    "get_index_k_scale_buffer",
    "get_index_k_fp4_payload_buffer",
    "get_index_k_fp4_scale_buffer",
    "get_low_ratio_index_k_dequant",
    "get_low_ratio_index_k_fp4",
    "get_indexer_compress_states",
    "get_attention_compress_states",
}


def is_layer_memory_getter(name: str, func) -> bool:
    if name.startswith(("_", "set_")):
        return False
    if not any(word in name for word in ("index_k", "indexer", "compress_state")):
        return False
    signature = inspect.signature(func)
    if list(signature.parameters)[1:2] != ["layer_id"]:
        return False
    return str(signature.return_annotation) not in ("int", "bool", "str")


def layer_memory_getters(cls) -> dict:
    return {
        name: func
        for name, func in inspect.getmembers(cls, inspect.isfunction)
        if is_layer_memory_getter(name, func)
    }


class LandingCounter:
    """Stand-in for HiCache's LayerDoneCounter: a wait lands the layer's transfer, then returns."""

    def __init__(self, page_rows: list[torch.Tensor]):
        self.page_rows = page_rows
        self.waits: list[int] = []

    def wait_until(self, layer: int) -> None:
        self.waits.append(layer)
        for rows in self.page_rows:
            rows.fill_(LANDED_BYTE)


def tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)


def first_c4_layer(pool) -> int:
    return next(
        layer_id
        for layer_id, item in enumerate(pool.layer_mapping)
        if item is not None and item.compress_ratio == 4
    )


def getters_not_waiting(pool) -> dict[str, str]:
    """getter name -> what is wrong, for every layer-memory getter of the pool's class."""
    layer_id = first_c4_layer(pool)
    page_rows = pool.c4_indexer_kv_pool.contiguous_page_row_buffers()
    problems = {}
    for name, func in layer_memory_getters(type(pool)).items():
        params = list(inspect.signature(func).parameters.values())[2:]
        missing = [p.name for p in params if p.default is p.empty and p.name not in ARGUMENTS]
        if missing:
            problems[name] = f"takes {missing}, for which this check has no value: add one"
            continue
        kwargs = {p.name: ARGUMENTS[p.name] for p in params if p.name in ARGUMENTS}
        for rows in page_rows:
            rows.zero_()
        counter = LandingCounter(page_rows)
        pool.layer_transfer_counter = counter
        try:
            result, error = getattr(pool, name)(layer_id, **kwargs), None
        except Exception as exc:  # a CUDA-only kernel, or a layout this pool lacks: after the wait
            result, error = None, exc
        finally:
            pool.layer_transfer_counter = None
        if counter.waits != [layer_id - pool.start_layer]:
            problems[name] = f"waited for {counter.waits}, not [{layer_id - pool.start_layer}]" + (
                f" (then raised {error!r})" if error else ""
            )
        elif any(not bool(t.count_nonzero()) for t in tensors_in(result)):
            problems[name] = "returned rows read before its layer's transfer landed"
    return problems


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def pool(request):
    _, pool = small_pool(request.param)
    assert pool.c4_indexer_kv_pool.index_k_dtype == request.param
    return pool


def test_rule_finds_the_getters(pool):
    found = set(layer_memory_getters(type(pool)))
    assert UPSTREAM_GETTERS <= found, f"the rule misses {UPSTREAM_GETTERS - found}"
    # index-k-bf16's getters are found by the same rule, without naming them in it.
    assert {"get_index_k_bf16_buffer", "get_index_k_bf16"} <= found
    # Page sizes and layout flags are not memory.
    assert not found & {"get_index_k_page_size", "low_ratio_index_k_is_split", "index_k_dtype_of"}


def test_every_getter_waits_for_its_layer_first(pool):
    assert getters_not_waiting(pool) == {}


def test_the_check_catches_a_getter_that_skips_or_delays_the_wait(pool):
    class Leaky(DeepSeekV4TokenToKVPool):
        def get_index_k_unwaited(self, layer_id: int) -> torch.Tensor:
            return self.c4_indexer_kv_pool.contiguous_page_row_buffers()[0]

        def get_index_k_copied_early(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
            rows = self.c4_indexer_kv_pool.contiguous_page_row_buffers()[0][0].clone()
            self.wait_layer_transfer(layer_id)
            return rows

    pool.__class__ = Leaky
    try:
        problems = getters_not_waiting(pool)
    finally:
        pool.__class__ = DeepSeekV4TokenToKVPool
    assert set(problems) == {"get_index_k_unwaited", "get_index_k_copied_early"}
    assert problems["get_index_k_unwaited"].startswith("waited for []")
    assert "before its layer's transfer landed" in problems["get_index_k_copied_early"]


def test_hicache_refuses_a_pool_with_an_ungated_getter(pool):
    """HiCache installs its counter with register_layer_transfer_counter; a pool whose getter
    would read before the wait refuses it, naming the getter."""
    counter = LandingCounter([])
    pool.register_layer_transfer_counter(counter)
    assert pool.layer_transfer_counter is counter
    pool.register_layer_transfer_counter(None)

    class Leaky(DeepSeekV4TokenToKVPool):
        def get_indexer_compress_states_unwaited(self, layer_id: int):
            return self.indexer_compress_state_pools[layer_id]

    pool.__class__ = Leaky
    try:
        with pytest.raises(RuntimeError, match="get_indexer_compress_states_unwaited$"):
            pool.register_layer_transfer_counter(counter)
    finally:
        pool.__class__ = DeepSeekV4TokenToKVPool
    assert pool.layer_transfer_counter is None
