"""Last in the suite: the sanitizer (sample 1.0) saw all of the suite's traffic on every server
the suite started (the corrupted one aside), and reported nothing."""

from __future__ import annotations

from support.live import sanitizer_counts


def test_no_sanitizer_violation_on_any_server_of_the_suite(plain, sanitized_servers):
    servers = sanitized_servers or [plain]
    report = {}
    for server in servers:
        if not server.alive():
            continue
        counts = sanitizer_counts(server)
        assert counts is not None, f"{server.name}: the sanitizer's counter is absent"
        report[server.name] = counts
    print("sanitizer violations by server:", report)
    assert all(sum(c.values()) == 0 for c in report.values()), report
