"""index-k-transfer-gate: every index-K / compress-state read waits for its layer's HiCache transfer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.wait_layer_transfer
               sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.register_layer_transfer_counter
  Why:         With HiCache on, index-K pages and compress states are loaded host -> device layer by
               layer; a read that does not first wait for its layer (wait_layer_transfer) scores
               stale keys. The twice-larger bf16 rows widened that race and corrupted 12-18% of
               tool-call responses at 60+ concurrent sessions in production (none with HiCache off
               or with fp8 keys).
  How:         DeepSeekV4TokenToKVPool.register_layer_transfer_counter (added) probes behaviour
               first: every get_* method that takes an argument is called with a layer id first
               (whatever the parameter is named) on one layer of each kind (sliding, c4, c128, low
               ratio), twice, with other bytes in the index-K and compress-state memory each time
               and a probe counter whose wait overwrites them with one sentinel. A result that
               differs was read before the wait (a copy, a computed value, or a view with no wait);
               so is a wait for another layer, and a parameter the probe cannot supply is refused
               too. HiCache start-up then fails with one line naming each such getter and layer
               kind; the probed memory is restored.
  Upstream:    upstream 0.5.23 gates its own getters (get_index_k_*, get_low_ratio_index_k_*,
               get_*_compress_states); the start-up check is not upstream
  Remove when: upstream checks its layer-transfer gates itself (or keeps an equivalent test) and
               index-k-bf16 is upstream.

How, in detail
  When HiCache installs its layer counter (register_layer_transfer_counter), the
  pool probes behaviour, not names: every get_* method of its class (subclasses
  included) that takes an argument is called with a layer id first, whatever the
  parameter is named, on one layer of each kind in the stage (sliding, c4, c128,
  low ratio), twice. Before each call the index-K and compress-state memory (first
  row of every tensor of the indexer and compress-state pools) holds another
  pattern; the probe counter's wait overwrites it with one sentinel, as a landed
  load does. A getter that waits before it reads returns the same both times; one
  that read first (a copy, a computed value, or a view with no wait) does not, and
  start-up stops with one line naming the getter, the layer kind and why. A wait
  for another layer, or a parameter the probe has no value for, is refused too. The
  probed memory is restored afterwards. Memory handed out for writing only
  (get_swa_raw_buffer, SWA) is outside this gate and not probed.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

from sglang_dsv4.fix import Add, Fix

_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"


def dsv4_tensors_in(value, depth: int = 0) -> list:
    """Tensors held by a value: itself, its items, or the attributes of an sglang object."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in dsv4_tensors_in(item, depth + 1)]
    if type(value).__module__.startswith("sglang.") and hasattr(value, "__dict__"):
        return [t for item in vars(value).values() for t in dsv4_tensors_in(item, depth + 1)]
    return []


def dsv4_snapshot(value):
    """What a caller holds right after a getter returns: tensors as bytes (a returned view is
    read now, as its caller would), anything else as it is."""
    tensors = dsv4_tensors_in(value)
    if not tensors:
        return ("value", repr(value))
    return ("tensors", [t.detach().reshape(-1).view(torch.uint8).clone() for t in tensors])


def dsv4_same_snapshot(a, b) -> bool:
    if a[0] != b[0] or a[0] == "value":
        return a == b
    return len(a[1]) == len(b[1]) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)
    )


def dsv4_gated_windows(self) -> list:
    """The first row of every index-K and compress-state tensor: the memory a HiCache layer
    load fills that this gate covers. The probe's arguments (slots 0-3, page 0) fall in it."""
    owners = [
        *self.index_pools.values(),
        *self.compress_state_pools,
        *self.indexer_compress_state_pools,
    ]
    windows, seen = [], set()
    for tensor in dsv4_tensors_in([o for o in owners if o is not None]):
        if tensor.dim() == 0 or tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        window = tensor[:1]
        if not window.is_contiguous() or (window.data_ptr(), window.nbytes) in seen:
            continue
        seen.add((window.data_ptr(), window.nbytes))
        windows.append(window.reshape(-1).view(torch.uint8))
    return windows


def dsv4_probe_layers(self) -> dict[str, int]:
    """One model layer of each kind in this stage: sliding (ratio 0), c4, c128, low ratio."""
    layers = {}
    for layer_id in range(self._stage_start, self._stage_end):
        item = self.layer_mapping[layer_id]
        ratio = 0 if item is None else item.compress_ratio
        kind = {0: "sliding", 4: "c4", 128: "c128"}.get(ratio, f"low-ratio c{ratio}")
        layers.setdefault(kind, layer_id)
    return layers


def dsv4_probe_arguments(self, func, layer_id):
    """(args, kwargs) for one probe call: the layer id first, whatever the parameter is named,
    then small values for the other parameters upstream's getters take (4 slots of page 0).
    None for a getter that takes no argument; a getter that requires a parameter the probe has
    no value for is refused (ValueError naming it), so no getter escapes unprobed."""
    slots = torch.arange(4, dtype=torch.int64, device=self.device)
    known = {
        "slots": slots,
        "loc": slots,
        "page_indices": torch.zeros((1, 1), dtype=torch.int32, device=self.device),
        "seq_len_tensor": torch.full((1,), 4, dtype=torch.int32, device=self.device),
        "seq_len_sum": 4,
        "max_seq_len": 4,
    }
    params = list(inspect.signature(func).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        return None
    kwargs = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in known:
            kwargs[p.name] = known[p.name]
        elif p.default is p.empty:
            raise ValueError(f"takes {p.name!r}, for which the probe has no value")
    return (layer_id,), kwargs


def dsv4_layer_getters_not_waiting(self) -> list[str]:
    """Each get_* method of this pool's class that hands out index-K or compress-state memory
    read before its layer's HiCache transfer landed, with the layer kind and why.

    Every get_* method that takes an argument is called with the layer id first, on one layer
    of each kind, twice: the covered memory (dsv4_gated_windows) holds one pattern before the
    call and another the second time, and the probe counter's wait overwrites both with the
    same sentinel, as a finished load does. A getter that waits before it reads returns the
    same thing both times; one that read (a copy, a value computed from it, or a view with no
    wait at all) returns two different things. The covered memory is restored afterwards.
    """
    windows = self.dsv4_gated_windows()
    saved = [w.clone() for w in windows]
    layer_waits: list[int] = []

    def land(layer):
        layer_waits.append(layer)
        for w in windows:
            w.fill_(0x3C)

    counter, problems = SimpleNamespace(wait_until=land), []
    previous = self.layer_transfer_counter
    self.layer_transfer_counter = counter
    try:
        for name, func in inspect.getmembers(type(self), inspect.isfunction):
            if not name.startswith("get_"):
                continue
            for kind, layer_id in self.dsv4_probe_layers().items():
                try:
                    call = self.dsv4_probe_arguments(func, layer_id)
                except ValueError as exc:
                    problems.append(f"{name} ({exc}: add one to dsv4_probe_arguments)")
                    break
                if call is None:
                    break  # takes no layer id
                seen = []
                for before in (0x11, 0x22):
                    for w in windows:
                        w.fill_(before)
                    layer_waits.clear()
                    try:
                        result = getattr(self, name)(*call[0], **call[1])
                        seen.append((dsv4_snapshot(result), None))
                    except Exception as exc:  # a CUDA-only kernel, a layer kind it refuses
                        seen.append((None, type(exc).__name__))
                    expected = layer_id - self.start_layer
                    if any(layer != expected for layer in layer_waits):
                        problems.append(
                            f"{name} ({kind} layer {layer_id}: waited for layers {layer_waits}, "
                            f"not {expected})"
                        )
                        break
                else:
                    (first, error_a), (second, error_b) = seen
                    if error_a != error_b or (
                        first is not None and not dsv4_same_snapshot(first, second)
                    ):
                        problems.append(
                            f"{name} ({kind} layer {layer_id}: returned index-K / compress-state "
                            "memory read before the layer's transfer landed)"
                        )
    finally:
        self.layer_transfer_counter = previous
        for w, s in zip(windows, saved, strict=True):
            w.copy_(s)
    return problems


def register_layer_transfer_counter(self, layer_transfer_counter):
    # HiCache calls this once at start-up; refuse it while any getter would read a layer before
    # that layer's host -> device transfer is done.
    if layer_transfer_counter is not None:
        not_waiting = self.dsv4_layer_getters_not_waiting()
        if not_waiting:
            raise RuntimeError(
                f"{type(self).__name__}: HiCache loads layers host -> device one at a time, and "
                f"these getters hand out index-K / compress-state memory read before waiting "
                f"for their layer (wait_layer_transfer): {'; '.join(not_waiting)}"
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
        "DeepSeekV4TokenToKVPool.register_layer_transfer_counter (added) probes behaviour "
        "first: every get_* method that takes an argument is called with a layer id first "
        "(whatever the parameter is named) on one layer of each kind (sliding, c4, c128, low "
        "ratio), twice, with other bytes in the index-K and compress-state memory each time and "
        "a probe counter whose wait overwrites them with one sentinel. A result that differs "
        "was read before the wait (a copy, a computed value, or a view with no wait); so is a "
        "wait for another layer, and a parameter the probe cannot supply is refused too. "
        "HiCache start-up then fails with one line naming each such getter and layer kind; the "
        "probed memory is restored."
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
        Add(owner=_POOL, func=dsv4_tensors_in),
        Add(owner=_POOL, func=dsv4_snapshot),
        Add(owner=_POOL, func=dsv4_same_snapshot),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=dsv4_gated_windows),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=dsv4_probe_layers),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=dsv4_probe_arguments),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=dsv4_layer_getters_not_waiting),
        Add(owner=f"{_POOL}.DeepSeekV4TokenToKVPool", func=register_layer_transfer_counter),
    ),
    imports={_POOL: ("import inspect", "from types import SimpleNamespace")},
)
