"""index-k-transfer-gate: every index-K and compress-state read waits for its layer's transfer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool
               (register_layer_transfer_counter added; its index-K / compress-state getters checked)
  Why:         With HiCache on, a layer's index-K pages and compress states are loaded host -> device
               layer by layer, and a reader must first wait for its layer (wait_layer_transfer). A
               read that skips the wait scores stale keys; the twice-larger bf16 rows widened that
               race and corrupted 12-18% of tool-call responses at 60+ concurrent sessions in
               production (none with HiCache off or with fp8 keys).
  How:         Before HiCache installs its layer counter on a DeepSeek-V4 pool, the pool probes
               every method that hands out index-K or compress-state memory for a layer (rule
               below) with a counter that stops the call at its first wait. A method that does not
               wait before anything else stops the server with one line naming it. The rule finds
               getters added later (the bf16 ones of index-k-bf16, or upstream's next ones) without
               a list to maintain.
  Rule:        a public method whose second parameter is `layer_id`, whose name says index-K or
               compress state (contains index_k, indexer or compress_state), that is not a setter
               (set_*) and is not annotated to return a scalar (int, bool, str: a page size or a
               flag, not memory).
  Upstream:    upstream 0.5.23 gates its own getters (get_index_k_*, get_low_ratio_index_k_*,
               get_*_compress_states all wait first); the start-up check is not upstream. The
               contract test (test/behaviour/test_transfer_gate.py) runs on fp8 and bf16 pools.
  Remove when: upstream checks its layer-transfer gates itself (or keeps an equivalent test) and
               index-k-bf16 is upstream.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

from sglang_dsv4.register import Add, Fix

_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"


def dsv4_is_layer_memory_getter(name: str, func) -> bool:
    """Whether a DeepSeekV4TokenToKVPool method hands out index-K or compress-state memory
    for one layer, so it must wait for that layer's HiCache transfer before anything else."""
    if name.startswith(("_", "set_")):
        return False
    if not any(word in name for word in ("index_k", "indexer", "compress_state")):
        return False
    signature = inspect.signature(func)
    params = list(signature.parameters)
    if len(params) < 2 or params[1] != "layer_id":
        return False
    # A page size or a layout flag is not memory; annotations are strings in that module.
    returns = signature.return_annotation
    return str(getattr(returns, "__name__", returns)) not in ("int", "bool", "str")


def dsv4_layer_getters_not_waiting(self) -> list[str]:
    """Names of this pool's index-K / compress-state getters that do not wait first.

    Each getter is called for one layer with a probe counter that records the wait and stops
    the call there, so no getter touches memory or runs a kernel; every other argument is None,
    which a getter that waits first never reads.
    """
    c4_layers = [
        layer_id
        for layer_id in range(self._stage_start, self._stage_end)
        if self.layer_mapping[layer_id] is not None
        and self.layer_mapping[layer_id].compress_ratio == 4
    ]
    layer_id = c4_layers[0] if c4_layers else self._stage_start
    expected = layer_id - self.start_layer
    reached = RuntimeError("layer transfer gate reached")
    seen: list[int] = []

    def wait_until(layer):
        seen.append(layer)
        raise reached

    probe = SimpleNamespace(wait_until=wait_until)
    saved = self.layer_transfer_counter
    not_waiting = []
    try:
        self.layer_transfer_counter = probe
        for name, func in inspect.getmembers(type(self), inspect.isfunction):
            if not dsv4_is_layer_memory_getter(name, func):
                continue
            seen.clear()
            others = {
                p.name: None
                for p in list(inspect.signature(func).parameters.values())[2:]
                if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            }
            try:
                getattr(self, name)(layer_id, **others)
            except Exception as exc:  # a getter that waits first stops at `reached`
                if exc is not reached:
                    seen.clear()
            if seen != [expected]:
                not_waiting.append(name)
    finally:
        self.layer_transfer_counter = saved
    return not_waiting


def register_layer_transfer_counter(self, layer_transfer_counter):
    # HiCache calls this once at start-up; refuse it while any getter would read a layer before
    # that layer's host -> device transfer is done.
    if layer_transfer_counter is not None:
        not_waiting = self.dsv4_layer_getters_not_waiting()
        if not_waiting:
            raise RuntimeError(
                f"{type(self).__name__}: HiCache loads layers host -> device one at a time, and "
                f"these index-K / compress-state getters read without waiting for their layer "
                f"(wait_layer_transfer) first: {', '.join(not_waiting)}"
            )
    super(DeepSeekV4TokenToKVPool, self).register_layer_transfer_counter(layer_transfer_counter)


FIX = Fix(
    id="index-k-transfer-gate",
    title="every index-K / compress-state read waits for its layer's HiCache transfer",
    area="mem_cache",
    why=(
        "With HiCache on, index-K pages and compress states are loaded host -> device layer by "
        "layer; a read that does not first wait for its layer (wait_layer_transfer) scores stale "
        "keys. The twice-larger bf16 rows widened that race and corrupted 12-18% of tool-call "
        "responses at 60+ concurrent sessions in production (none with HiCache off or with fp8 "
        "keys)."
    ),
    how=(
        "DeepSeekV4TokenToKVPool.register_layer_transfer_counter (added) first probes every "
        "method that hands out index-K or compress-state memory for a layer (public, second "
        "parameter layer_id, name with index_k / indexer / compress_state, not set_*, not "
        "returning int / bool / str) with a counter that stops the call at its first wait; "
        "HiCache start-up fails with one line naming any getter that does not wait first. "
        "Getters added later (index-k-bf16's, upstream's next) are found by the same rule."
    ),
    upstream=(
        "upstream 0.5.23 gates its own getters (get_index_k_*, get_low_ratio_index_k_*, "
        "get_*_compress_states); the start-up check is not upstream"
    ),
    remove_when=(
        "upstream checks its layer-transfer gates itself (or keeps an equivalent test) and "
        "index-k-bf16 is upstream."
    ),
    tests=("test/behaviour/test_transfer_gate.py",),
    targets=(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.wait_layer_transfer",
        f"{_POOL}.DeepSeekV4TokenToKVPool.register_layer_transfer_counter",
    ),
    adds=(
        Add(owner=_POOL, func=dsv4_is_layer_memory_getter),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=dsv4_layer_getters_not_waiting),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=register_layer_transfer_counter),
    ),
    imports={_POOL: ("import inspect", "from types import SimpleNamespace")},
)
