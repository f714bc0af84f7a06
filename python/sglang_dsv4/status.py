"""`sglang-dsv4 status`: is the distribution in force in a process started like SGLang's?

It loads plugins through upstream's own `load_plugins()` (entry-point discovery, SGLANG_PLUGINS
filtering, HookRegistry), exactly as `python -m sglang.launch_server` does. A server applies each
fix when upstream imports the module it hooks; status imports them all (`plugin.settle()`), so
every fix is checked now, then reports.
"""

from __future__ import annotations

import json
import os


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 unless the plugin ran and every implemented fix is applied",
    )


def cuda_device() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "none", "compute_capability": None}
    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}


def collect() -> dict:
    from sglang.srt.plugins import load_plugins

    from sglang_dsv4 import UPSTREAM_PIN, __version__, cpu_backend, plugin, sanitizer, settings
    from sglang_dsv4.cli import step
    from sglang_dsv4.fixes import REGISTER

    refusal = None
    try:
        step("sglang-dsv4 status: loading plugins")
        load_plugins()
        step("sglang-dsv4 status: importing what each fix hooks, applying and checking it")
        if plugin.STATE:
            refusal = next(iter(plugin.settle(refuse=False)), None)
    except plugin.Refusal as exc:
        refusal = str(exc.code)
    try:
        dtype = settings.current().index_k_dtype
    except settings.SettingsError as exc:
        dtype = f"invalid ({exc})"
    loaded = bool(plugin.STATE)
    fixes = []
    for entry in REGISTER:
        fix = entry.load()
        state = plugin.STATE.get(fix.id)
        if state is None:
            status, reason = "not loaded", refusal or "the dsv4_sm120 plugin did not run"
        else:
            status, reason = state.status, state.reason
        fixes.append(
            {
                "id": fix.id,
                "title": fix.title,
                "implemented": fix.implemented,
                "applied": status == plugin.APPLIED,
                "status": status,
                "reason": reason,
                "upstream": fix.upstream,
                "targets": list(fix.targets),
            }
        )
    return {
        "distribution": __version__,
        "upstream": {"version": plugin.upstream_version(), "pin": UPSTREAM_PIN},
        "plugin_loaded": loaded,
        "sglang_plugins": os.environ.get("SGLANG_PLUGINS") or None,
        "refusal": refusal,
        "index_k_dtype": dtype,
        "cuda_device": cuda_device(),
        "fixes": fixes,
        "sanitizer": sanitizer.describe(),
        "cpu_backend": cpu_backend.describe(plugin.STATE),
    }


def strict_ok(report: dict) -> bool:
    return (
        report["plugin_loaded"]
        and report["refusal"] is None
        and all(f["applied"] for f in report["fixes"] if f["implemented"])
    )


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    up = report["upstream"]
    dev = report["cuda_device"]
    cc = f" (compute capability {dev['compute_capability']})" if dev["compute_capability"] else ""
    console.print(f"sglang-dsv4-sm120 {report['distribution']}")
    console.print(f"upstream sglang   {up['version']} (pin {up['pin']})")
    console.print(f"plugin            {'loaded' if report['plugin_loaded'] else 'NOT loaded'}")
    console.print(f"index-K dtype     {report['index_k_dtype']}")
    console.print(f"CUDA device       {dev['name']}{cc}")
    console.print(f"sanitizer         {report['sanitizer']['summary']}")
    console.print(f"cpu backend       {report['cpu_backend']['summary']}")
    if report["refusal"]:
        console.print(f"[bold red]{report['refusal']}[/]")
    table = Table(show_lines=False)
    for col in ("fix", "status", "upstream"):
        table.add_column(col, overflow="fold")
    for f in report["fixes"]:
        status = f["status"] + (f": {f['reason']}" if f["reason"] else "")
        table.add_row(f"{f['id']}\n{f['title']}", status, f["upstream"])
    console.print(table)


def run(args) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    if args.strict and not strict_ok(report):
        return 1
    return 0
