"""The sanitizer's records: violation kinds, one violation, the Prometheus counter, and the
ledger of pages per allocator (live or free, generation, the pool buffers to poison)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang_dsv4.metrics import (
    SANITIZER_KINDS,
    SANITIZER_LABELS,
    SANITIZER_VIOLATIONS,
    SANITIZER_VIOLATIONS_HELP,
)

logger = logging.getLogger("sglang_dsv4.sanitizer")

KINDS = SANITIZER_KINDS
METRIC_NAME = SANITIZER_VIOLATIONS
POISON_BYTE = 0xFF
# Share of the reference top-k the kernel's top-k must contain. bf16: the kernel and the reference
# score the same bf16 bytes in fp32, so only near-ties may differ. fp8: the reference dequantizes
# the same e4m3 bytes; accumulation order differs more.
SHADOW_MIN_AGREEMENT = {"bf16": 0.98, "fp8": 0.95}
INDEX_HEAD_DIM = 128
_KEEP_VIOLATIONS = 1000  # the most recent ones, for tests and `status`


@dataclass(frozen=True)
class Violation:
    kind: str
    request: str | None = None
    layer: int | None = None
    page: int | None = None
    slot: int | None = None
    expected: str = ""
    found: str = ""

    def line(self) -> str:
        return (
            f"sanitizer violation kind={self.kind} request={self.request} layer={self.layer} "
            f"page={self.page} slot={self.slot} expected={self.expected} found={self.found}"
        )


_COUNTER = None  # the process's Prometheus counter, created on first use


def _violation_counter():
    """sglang:dsv4_sanitizer_violations_total{kind}, created on first use (in every scheduler
    process, so upstream's multiprocess collector adds them up)."""
    global _COUNTER
    if _COUNTER is None:
        from prometheus_client import Counter

        _COUNTER = Counter(
            SANITIZER_VIOLATIONS, SANITIZER_VIOLATIONS_HELP, labelnames=list(SANITIZER_LABELS)
        )
    return _COUNTER


def _pages(indices, page_size: int) -> list[int]:
    """Distinct page ids of token slots (a tensor or a sequence), negative slots dropped."""
    flat = torch.as_tensor(indices).reshape(-1).to("cpu", torch.int64)
    flat = flat[flat >= 0]
    return torch.unique(flat // page_size).tolist()


class PageLedger:
    """Per allocator: which pages are live, their generation, and the pool buffers to poison."""

    def __init__(self, num_pages: int, page_size: int, kvcache=None):
        self.page_size = page_size
        self.live = torch.zeros(num_pages + 1, dtype=torch.bool)
        self.generation = torch.zeros(num_pages + 1, dtype=torch.int64)
        self.kvcache = kvcache
        # model layer id -> generation of the page when each c4 slot was last written
        self.written: dict[int, torch.Tensor] = {}

    def grow_to(self, page: int) -> None:
        if page >= len(self.live):
            extra = page + 1 - len(self.live)
            self.live = torch.cat((self.live, torch.zeros(extra, dtype=torch.bool)))
            self.generation = torch.cat((self.generation, torch.zeros(extra, dtype=torch.int64)))
