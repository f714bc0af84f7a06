"""The plan, the comparison and the sweep as tables on the terminal (rich)."""

from __future__ import annotations

from pathlib import Path

# Not from sglang_dsv4.fixes: these builders also serve the run on upstream patched by the
# exported series, which imports no fix module (sglang_dsv4.index_k_dtype imports nothing).
from sglang_dsv4.index_k_dtype import (
    INDEX_K_DTYPES,
)
from sglang_dsv4.plan.chain import GIB

# --- rendering --------------------------------------------------------------------------------


def _gib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / GIB:.2f}"


def _count(value) -> str:
    return "" if value is None else f"{value:,}"


def _headline(p: dict) -> str:
    model = Path(p["model"]).name
    mtp = ", MTP" if p["mtp"] else ""
    return (
        f"{model}: TP {p['tp']}, {p['disaggregation_mode']}, page {p['page_size']}{mtp}, "
        f"KV memory {p['kv_memory_bytes'] / GIB:.2f} GiB per rank ({p['budget_source']})"
    )


def _where_each_gib_goes(p: dict):
    from rich.table import Table

    table = Table(title=f"where each GiB of one {p['gpu']} goes (computed, not measured)")
    table.add_column("")
    table.add_column("GiB", justify="right")
    if p["budget_source"] == "derived":
        table.add_row("GPU memory", _gib(p["gpu_bytes"]))
        table.add_row(
            f"weights per rank (checkpoint / TP {p['tp']})", _gib(p["weights_bytes_per_rank"])
        )
        table.add_row(
            f"activations + CUDA graphs (1 - {p['mem_fraction_static']:g}, "
            f"{p['mem_fraction_source']})",
            _gib(p["reserve_bytes"]),
        )
    table.add_row("KV budget", _gib(p["kv_memory_bytes"]), style="bold")
    table.add_row("  KV pools allocated", _gib(p["allocated_bytes"]))
    table.add_row(
        f"  left unallocated ({p['unallocated_bytes']:,} B, < one page of every pool)",
        _gib(p["unallocated_bytes"]),
    )
    table.add_row(
        "request-to-token table (beside the pools; upstream does not price it)",
        _gib(p["req_to_token_bytes"]),
    )
    return table


def render_plan(p: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"Memory plan per rank, index-K {p['index_k_dtype']}: {_headline(p)}")
    console.print(f"index-K dtype from: {p['index_k_dtype_source']}")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(justify="right")
    facts.add_row("bytes per full token", f"{p['bytes_per_full_token']:,.2f}")
    facts.add_row("bytes per SWA token", f"{p['bytes_per_swa_token']:,.2f}")
    facts.add_row("indexer bytes per token", f"{p['indexer_bytes_per_token']}")
    facts.add_row("max total (full) tokens", _count(p["max_total_num_tokens"]))
    facts.add_row("max running requests", _count(p["max_running_requests"]))
    facts.add_row("one more page of every pool, bytes", _count(p["one_more_page_bytes"]))
    console.print(facts)
    if p["stored_indexer_bytes_per_token"] not in (None, p["indexer_bytes_per_token"]):
        console.print(
            f"[bold red]the c4 indexer pool stores {p['stored_indexer_bytes_per_token']} B/token "
            f"but is priced at {p['indexer_bytes_per_token']}: fix pool-sizing-bf16 is not in force[/]"
        )
    if p["unallocated_bytes"] < 0:
        console.print(
            f"[bold red]the pools take {-p['unallocated_bytes']:,} B more than the budget: "
            "fix pool-sizing-bf16 is not in force[/]"
        )
    pools = Table(title="pools (allocated on the meta device by upstream's pool classes)")
    pools.add_column("pool")
    pools.add_column("tokens / rows", justify="right")
    pools.add_column("GiB", justify="right")
    for name, part in p["pools"].items():
        pools.add_row(name, _count(part["tokens"]), _gib(part["bytes"]))
    pools.add_row("total", "", _gib(p["allocated_bytes"]), style="bold")
    console.print(pools)
    console.print(_where_each_gib_goes(p))
    if "sessions" in p:
        s = p["sessions"]
        console.print(
            f"Sessions of {p['context']:,} tokens: {s['per_rank']:,} per rank (limited by "
            f"{s['limited_by']}), {s['deployment']:,} for {p['gpus']} GPUs at TP {p['tp']}"
        )
        by_dtype = p.get("sessions_by_index_k_dtype")
        if by_dtype:
            console.print(
                "  per rank by index-K dtype: "
                + ", ".join(f"{d} {by_dtype[d]:,}" for d in INDEX_K_DTYPES)
                + f"; bf16 costs {by_dtype['bf16_cost_vs_fp8']:,} sessions per rank against fp8"
            )
    launch = p["launch"]
    console.print("Launch (bare metal):")
    console.print(f"  {launch['command']}", soft_wrap=True)
    console.print("Image environment:")
    for name, value in launch["image_environment"].items():
        console.print(f"  {name}={value}", soft_wrap=True)


def render_compare(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    plans = report["compare"]
    console.print(f"Memory plan per rank by index-K dtype: {_headline(plans[0])}")
    table = Table()
    table.add_column("")
    for p in plans:
        table.add_column(p["index_k_dtype"], justify="right")
    rows = [
        ("bytes per full token", lambda p: f"{p['bytes_per_full_token']:,.2f}"),
        ("bytes per SWA token", lambda p: f"{p['bytes_per_swa_token']:,.2f}"),
        ("indexer bytes per token", lambda p: f"{p['indexer_bytes_per_token']}"),
        ("max total (full) tokens", lambda p: _count(p["max_total_num_tokens"])),
        ("max running requests", lambda p: _count(p["max_running_requests"])),
    ]
    if "sessions" in plans[0]:
        rows.append(("sessions per rank", lambda p: _count(p["sessions"]["per_rank"])))
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in plans))
    for name in plans[0]["pools"]:
        table.add_row(f"{name} GiB", *(_gib(p["pools"][name]["bytes"]) for p in plans))
    table.add_row("allocated GiB", *(_gib(p["allocated_bytes"]) for p in plans), style="bold")
    table.add_row("unallocated GiB", *(_gib(p["unallocated_bytes"]) for p in plans))
    console.print(table)
    over = report["unfixed_bf16_overcommit_bytes"]
    console.print(
        f"Unfixed sizing (c4 indexer priced as fp8) with bf16 keys over-commits {over / GIB:.2f} "
        f"GiB per rank at a KV budget of {report['kv_memory_bytes'] / GIB:.2f} GiB per rank."
    )


def render_sweep(report: dict) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    console.print(
        f"{len(report['cells'])} cells: {report['sized']} sized and built, {report['refused']} "
        "refused by upstream (budget smaller than the pools' minimum)"
    )
    worst = report["worst_cell"]
    if worst is not None:
        console.print(
            f"worst allocated - budget: {report['worst_over_bytes']:,} B ({_cell_name(worst)}); "
            f"most left unallocated: {report['max_unused_bytes']:,} B"
        )


def _cell_name(cell: dict) -> str:
    requests = cell["max_running_requests"] or "default"
    return (
        f"TP {cell['tp']}, {cell['disaggregation_mode']}, page {cell['page_size']}, "
        f"{cell['index_k_dtype']}, {cell['kv_gib']} GiB, max running requests {requests}, "
        f"MTP {'on' if cell['mtp'] else 'off'}"
    )
