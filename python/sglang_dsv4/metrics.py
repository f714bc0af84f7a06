"""The Prometheus metrics a server of this distribution exposes: names, labels, label values.

One home for what the sanitizer and fix nixl-bootstrap-cascade create, and what the release gate,
the mock server, dashboards and tests read. Torch-free and upstream-free: a benchmark reads it
without importing either.

The NIXL counter is created by code the fix carries into upstream's nixl/conn.py, which spells
the name out (it cannot import the distribution); test/behaviour/test_nixl_bootstrap.py reads
the counter under the name below, so the two cannot drift apart.
"""

from __future__ import annotations

# sglang_dsv4.sanitizer (SGLANG_DSV4_SANITIZE=1): one sample per kind, every kind created at 0.
SANITIZER_VIOLATIONS = "sglang:dsv4_sanitizer_violations_total"
SANITIZER_VIOLATIONS_HELP = (
    "DeepSeek-V4 KV / index-K sanitizer violations (SGLANG_DSV4_SANITIZE=1), by kind."
)
SANITIZER_LABELS = ("kind",)
SANITIZER_KINDS = (
    "use_after_free",
    "foreign_page",
    "double_owner",
    "over_commit",
    "unwritten_read",
    "shadow_mismatch",
    "pd_checksum",
    "foreign_write",
    "padded_write",
    "early_free",
    "hicache_checksum",
    "late_write",
)

# nixl-bootstrap-cascade: the NIXL connector's control threads, by thread role and event.
NIXL_CONTROL_THREAD_EVENTS = "sglang:nixl_control_thread_events_total"
NIXL_CONTROL_THREAD_LABELS = ("thread", "event")
# nixl-bootstrap-cascade: KV slots a decode holds out of its free list for rooms it failed, until
# their prefill acks the abort or is declared dead (a gauge, summed over live processes).
NIXL_KV_QUARANTINED_SLOTS = "sglang:nixl_kv_quarantined_slots"


def family_names(metric: str) -> tuple[str, str]:
    """The names a counter's family may carry in a /metrics page: Prometheus' text parser names a
    counter's family without its _total suffix."""
    return metric, metric.removesuffix("_total")
