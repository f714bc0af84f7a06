"""A test hook that overwrites one live index-K page inside a running server.

Attached with upstream's own `--forward-hooks` (sglang/srt/model_executor/hook_manager.py), which
registers a PyTorch forward hook on the modules it names, after any graph capture:

    --forward-hooks '[{"name": "corrupt", "target_modules": ["model.layers.1.self_attn"],
                       "hook_factory": "support.corrupt_index_k:factory",
                       "config": {"arm_at_tokens": 256, "after_decode_steps": 4}}]'

Upstream calls the attention module with keyword arguments only, and a forward hook sees only
positional ones, so the hook reads the step from upstream's forward context instead: the
attention backend (`get_attn_backend()`), its pool and the metadata of the forward it runs. It
arms on the first forward of at least `arm_at_tokens` query tokens (the test's prompt; the
server's own health checks are one token), then counts one-token forwards (the decode steps of
the test's request, the only one running). On the Nth it fills the first index-K page the
indexer reads for that request in this c4 layer with 0xFF bytes (the bytes the sanitizer poisons
free pages with) and logs one WARNING line naming the layer and page. The next decode step's
indexer reads that page; a sanitizer with sample 1.0 must report it (`unwritten_read`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CORRUPTED_LINE = "test hook: index-K page overwritten"


def _step():
    """(query tokens of this forward, the attention backend) from upstream's forward context."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

    if not has_forward_context():
        return 0, None
    backend = get_attn_backend()
    metadata = getattr(backend, "forward_metadata", None)
    core = getattr(metadata, "core_attn_metadata", None)
    if core is None:
        return 0, None
    return int(core.positions_casual.numel()), backend


def _corrupt(layer_id: int, backend) -> str | None:
    pool = backend.token_to_kv_pool
    indexer = backend.forward_metadata.indexer_metadata
    ratio, pool_layer, _ = pool.layer_mapping[layer_id]
    index_pool = pool.index_pools.get(ratio)
    if index_pool is None or indexer is None:
        return None
    buffer = index_pool.index_k_with_scale_buffer[pool_layer - index_pool.start_layer]
    page = int(indexer.page_table[0, 0])
    buffer[page].fill_(0xFF)
    return f"{CORRUPTED_LINE}: layer={layer_id} page={page}"


def factory(config: dict):
    arm_at = int(config.get("arm_at_tokens", 256))
    after = int(config.get("after_decode_steps", 4))
    state = {"armed": False, "decodes": 0, "done": False}

    def hook(module, inputs, output):
        if state["done"]:
            return None
        tokens, backend = _step()
        if tokens >= arm_at:
            state["armed"] = True
            return None
        if not state["armed"] or tokens != 1:
            return None
        state["decodes"] += 1
        if state["decodes"] < after:
            return None
        line = _corrupt(module.layer_id, backend)
        if line:
            state["done"] = True
            logger.warning(line)
        return None

    return hook
