"""Liveness of a PD deployment: every server healthy and able to generate, one line each.

    sglang-dsv4 liveness --prefill http://p0:30000 --decode http://d0:30001 \\
        --router http://router:8000

For each server: GET /health, then one short generation. Prefill and decode servers cannot serve
a request alone in PD mode, so for them the generation is upstream's GET /health_generate (one
token, run inside the server with a fake bootstrap). Through the router it is a real chat
completion of a few tokens, which crosses prefill, the KV transfer and decode. Exit status 0 only
when every server answers both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from sglang_dsv4.acceptance.arg_types import DefaultsHelpFormatter

ROLES = ("prefill", "decode", "router")


@dataclass
class Check:
    role: str
    url: str
    ok: bool
    summary: str


def _request(url: str, timeout: float, body: dict | None = None) -> tuple[int, bytes, float]:
    """(status, body, seconds); raises OSError (URLError included) when there is no answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, error.read(), time.monotonic() - started


def _why(exc: OSError) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
        return "timed out"
    return str(getattr(reason, "strerror", None) or reason)


def _model(url: str, timeout: float) -> str:
    status, body, _ = _request(f"{url}/v1/models", timeout)
    if status != 200:
        raise ValueError(f"/v1/models answered {status}")
    models = json.loads(body).get("data") or []
    if not models:
        raise ValueError("/v1/models lists no model")
    return models[0]["id"]


def _generate(role: str, url: str, model: str | None, timeout: float) -> str:
    """One short generation; returns its summary or raises ValueError / OSError."""
    if role != "router":
        status, _, seconds = _request(f"{url}/health_generate", timeout)
        if status != 200:
            raise ValueError(f"/health_generate answered {status}")
        return f"one-token generation in {seconds:.2f} s"
    request = {
        "model": model or _model(url, timeout),
        "messages": [{"role": "user", "content": "Reply with the single word: ready"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, body, seconds = _request(f"{url}/v1/chat/completions", timeout, request)
    if status != 200:
        raise ValueError(
            f"/v1/chat/completions answered {status}: {body[:120].decode(errors='replace')}"
        )
    answer = json.loads(body)
    text = (answer["choices"][0]["message"].get("content") or "").strip()
    tokens = (answer.get("usage") or {}).get("completion_tokens", "?")
    if not text and tokens in (0, "?"):
        raise ValueError("chat completion came back empty")
    return f"chat completion, {tokens} tokens in {seconds:.2f} s: {text[:40]!r}"


def check(role: str, url: str, model: str | None, timeout: float) -> Check:
    url = url.rstrip("/")
    try:
        status, _, seconds = _request(f"{url}/health", timeout)
    except OSError as exc:
        return Check(role, url, False, f"health: no answer ({_why(exc)})")
    if status != 200:
        return Check(role, url, False, f"health: HTTP {status}")
    health = f"health 200 in {1000 * seconds:.0f} ms"
    try:
        generated = _generate(role, url, model, timeout)
    except OSError as exc:
        return Check(role, url, False, f"{health}; generation: no answer ({_why(exc)})")
    except (ValueError, KeyError, IndexError) as exc:
        return Check(role, url, False, f"{health}; generation: {exc}")
    return Check(role, url, True, f"{health}; {generated}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dsv4 liveness",
        formatter_class=DefaultsHelpFormatter,
        description="Health and one short generation per server of a PD deployment.",
    )
    for role in ROLES:
        parser.add_argument(
            f"--{role}",
            action="append",
            default=[],
            metavar="URL",
            help=f"a {role} server (repeat for several)",
        )
    parser.add_argument(
        "--model", help="model id for the router (default: the first of /v1/models)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    targets = [(role, url) for role in ROLES for url in getattr(args, role)]
    if not targets:
        parser.error("name at least one server: --prefill, --decode or --router URL")
    for _, url in targets:
        if not url.startswith(("http://", "https://")):
            parser.error(f"a server URL starts with http:// or https://, not {url!r}")
    results = [check(role, url, args.model, args.timeout) for role, url in targets]
    for result in results:
        print(f"{'OK  ' if result.ok else 'FAIL'} {result.role:<7} {result.url}  {result.summary}")
    alive = sum(result.ok for result in results)
    print(f"{alive} of {len(results)} servers alive")
    return 0 if alive == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
