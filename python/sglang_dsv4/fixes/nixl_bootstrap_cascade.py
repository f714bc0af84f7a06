"""nixl-bootstrap-cascade: a prefill rank's NIXL bootstrap thread survives bad messages.

Register entry
  Target:      sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread
  Why:         One thread on each prefill rank receives everything decode ranks send. In 0.5.23 any
               exception ends it (a foreign message fails an assert, a truncated one raises while
               parsed); from then on no request to that rank leaves KVPoll.Bootstrapping until the
               bootstrap timeout (300 s), and decode aborts request after request: the cascade that
               wedged production.
  How:         Each message is handled in isolation; a bad one is dropped with a rate-limited log
               line and fails only the room it names. If the thread dies anyway, every waiting room
               fails at once and the thread restarts with bounded back-off.
  Upstream:    PR #30352 (ABORT handling in this thread) and PR #34692 (bootstrap timeout) are
               upstream; per-message isolation and restart are not.
  Remove when: upstream's bootstrap thread isolates messages and fails waiting rooms on death.
"""

from __future__ import annotations

from sglang_dsv4.register import Fix

FIX = Fix(
    id="nixl-bootstrap-cascade",
    title="NIXL prefill bootstrap thread survives bad messages",
    area="disaggregation",
    why=(
        "One thread on each prefill rank (NixlKVManager._start_bootstrap_thread) receives everything "
        "decode ranks send. In 0.5.23 any exception ends it: a foreign message fails an assert, a "
        "truncated one raises while parsed. From then on no request to that rank leaves "
        "KVPoll.Bootstrapping until the bootstrap timeout (300 s), and decode aborts request after "
        "request: the cascade that wedged production."
    ),
    how=(
        "Each message is handled in isolation: a bad one is dropped with a rate-limited log line "
        "and fails only the live room it names. If the thread dies anyway, every room waiting on "
        "the rank fails at once and the thread restarts with bounded back-off."
    ),
    upstream=(
        "PR #30352 (ABORT in this thread) and PR #34692 (bootstrap timeout) are upstream; "
        "per-message isolation and restart are not upstream"
    ),
    remove_when="upstream's bootstrap thread isolates messages and fails waiting rooms on death.",
    targets=("sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread",),
)
