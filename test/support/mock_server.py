"""A small OpenAI-compatible server that answers like a tool-using model, for dry runs and tests.

    PYTHONPATH=test python -m support.mock_server --port 8123 --leak-rate 0.05 --http-error-rate 0.01

It listens on 127.0.0.1 only and serves what the benchmarks use: /v1/chat/completions (plain and
streamed, tool calls included), /v1/models, /health, /health_generate, /metrics (the Prometheus
counters the release gate reads: sanitizer violations, NIXL control-thread events), and
/mock/stats, which counts what it injected so a test can compare a measurement with the truth.

Answers are a pure function of the request (a hash of the seed and the messages picks the tool
call, the text and the corruption), like a model at temperature 0, so a run is reproducible
whatever the request order. HTTP errors and stalls are drawn in arrival order from their own
seeded generator instead, so that a retried request can succeed. The mock counts 4 characters
of prompt as one token and one streamed word as one output token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import selectors
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import prometheus_client
from aiohttp import web
from sglang_dsv4 import metrics
from sglang_dsv4.acceptance import dsml
from sglang_dsv4.acceptance.arg_types import DefaultsHelpFormatter, rate, seconds
from sglang_dsv4.acceptance.corruption import KINDS

TEST_DIR = Path(__file__).resolve().parent.parent  # `-m support.mock_server` runs from here

WORDS = (
    "the build cache test module parser request server config layer token batch queue worker "
    "result error path file function value index buffer kernel memory page prefix decode prefill "
    "router stream schedule update check return import class method field record offset length "
    "limit handle retry timeout commit branch merge review patch version release deploy metric "
    "latency throughput sample window context session report summary change reason step next"
).split()
MODULES = ("core", "io", "net", "cache", "cli", "model", "utils")
RATE_FLAGS = {
    "dsml_leak": "--leak-rate",
    "truncated_markup": "--truncated-rate",
    "malformed_tool_call": "--malformed-rate",
    "repetition": "--repetition-rate",
}
COMMANDS = ("pytest -q", "git status", "make lint", "ls -la", "python -m build", "git diff --stat")
# The counters a DeepSeek-V4 server of this distribution exposes on /metrics, as it names them.
SANITIZER_METRIC = metrics.SANITIZER_VIOLATIONS
SANITIZER_KINDS = metrics.SANITIZER_KINDS
NIXL_METRIC = metrics.NIXL_CONTROL_THREAD_EVENTS


@dataclass
class Settings:
    model: str = "mock-dsv4"
    seed: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # corruption kind -> share of answers
    http_error_rate: float = 0.0
    stall_rate: float = 0.0
    stall_seconds: float = 30.0
    ttft: float = 0.0
    itl: float = 0.0
    unhealthy: bool = False
    sanitizer: bool = False  # expose the sanitizer's counter (every kind at zero to begin with)
    sanitizer_violations: tuple[str, ...] = ()  # kinds counted once per chat answer
    nixl_death: str | None = None  # this control thread dies once, at the first chat answer
    slow_after: int | None = None  # chat requests served at full speed; later ones use slow_itl
    slow_itl: float = 0.0


@dataclass
class Answer:
    content: str | None
    tool_calls: list[tuple[str, str]]  # (name, arguments text)
    finish_reason: str
    injected: str | None
    ident: str = ""  # names the tool calls; fixed by the request, so runs repeat exactly


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _prose(rng: random.Random, words: int) -> str:
    sentences, left = [], words
    while left > 0:
        size = min(left, rng.randint(6, 14))
        sentences.append(_sentence(rng, size))
        left -= size
    return " ".join(sentences)


def _value(name: str, schema: dict, rng: random.Random):
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if kind == "integer":
        return rng.randint(1, 200)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(name, schema.get("items", {}), rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {}
    if "path" in name or "file" in name:
        return f"src/{rng.choice(MODULES)}/{rng.choice(WORDS)}_{rng.randint(1, 9)}.py"
    if "command" in name:
        return rng.choice(COMMANDS)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))


def _arguments(schema: dict, rng: random.Random) -> dict:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return {
        name: _value(name, spec, rng)
        for name, spec in properties.items()
        if name in required or rng.random() < 0.4
    }


def _offered_tools(body: dict) -> list[tuple[str, dict]]:
    if body.get("tool_choice") == "none":
        return []
    tools = []
    for tool in body.get("tools") or []:
        function = tool.get("function") or {}
        if function.get("name"):
            tools.append((function["name"], function.get("parameters") or {}))
    return tools


class MockModel:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.faults = random.Random(f"faults:{settings.seed}")
        self.stats = Counter()

    def _digest(self, messages: list) -> bytes:
        canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(f"{self.settings.seed}\n{canonical}".encode()).digest()

    def _injected_kind(self, draw: float) -> str | None:
        edge = 0.0
        for kind in KINDS:
            edge += self.settings.rates.get(kind, 0.0)
            if draw < edge:
                return kind
        return None

    def answer(self, body: dict) -> Answer:
        """The answer to a request, and the corruption injected into it if any."""
        messages = body["messages"]
        digest = self._digest(messages)
        answer = self._answer(
            body, int.from_bytes(digest[:8], "big") / 2**64, random.Random(digest[8:16])
        )
        answer.ident = digest[16:22].hex()
        return answer

    def _answer(self, body: dict, draw: float, rng: random.Random) -> Answer:
        messages = body["messages"]
        tools = _offered_tools(body)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
        kind = self._injected_kind(draw)
        if kind is not None:
            return self._corrupted(kind, tools, rng, max_tokens)
        last_role = messages[-1].get("role") if messages else "user"
        wants_tool = {"user": 0.85, "tool": 0.5}.get(last_role, 0.0)
        if tools and rng.random() < wants_tool:
            calls = [self._call(tools, rng) for _ in range(2 if rng.random() < 0.15 else 1)]
            preamble = _sentence(rng, rng.randint(5, 10)) if rng.random() < 0.3 else None
            return Answer(preamble, [(n, json.dumps(a)) for n, a in calls], "tool_calls", None)
        if body.get("ignore_eos"):
            return Answer(_prose(rng, max_tokens), [], "length", None)
        words = rng.randint(15, 60)
        finish = "length" if words > max_tokens else "stop"
        return Answer(_prose(rng, min(words, max_tokens)), [], finish, None)

    def _call(self, tools: list[tuple[str, dict]], rng: random.Random) -> tuple[str, dict]:
        name, schema = rng.choice(tools)
        return name, _arguments(schema, rng)

    def _corrupted(self, kind: str, tools, rng: random.Random, max_tokens: int) -> Answer:
        tools = tools or [("search", {"properties": {"query": {"type": "string"}}})]
        call = self._call(tools, rng)
        preamble = _sentence(rng, rng.randint(5, 10))
        if kind == "dsml_leak":
            return Answer(f"{preamble}\n\n{dsml.render_tool_calls([call])}", [], "stop", kind)
        if kind == "truncated_markup":
            block = dsml.render_tool_calls([call])
            # Any prefix holding at least '<｜' is unfinished markup.
            return Answer(
                f"{preamble}\n\n{block[: rng.randint(2, len(block) - 1)]}", [], "length", kind
            )
        if kind == "repetition":
            unit = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            loop = " ".join([unit] * rng.randint(12, 20))
            return Answer(f"{preamble} {loop}", [], "length", kind)
        name, arguments = call
        variant = rng.choice(("unknown", "json", "required"))
        if variant == "unknown":
            return Answer(None, [(f"{name}_v2", json.dumps(arguments))], "tool_calls", kind)
        if variant == "json":
            broken = json.dumps(arguments)[:-1] + ',"'
            return Answer(None, [(name, broken)], "tool_calls", kind)
        required = [p for p in dict(tools).get(name, {}).get("required", ()) if p in arguments]
        if not required:  # nothing required to leave out: call a function nobody offered
            return Answer(None, [(f"{name}_v2", json.dumps(arguments))], "tool_calls", kind)
        arguments.pop(required[0])
        return Answer(None, [(name, json.dumps(arguments))], "tool_calls", kind)

    def fault(self) -> str | None:
        """'error', 'stall' or None for the next request, in arrival order."""
        draw = self.faults.random()
        if draw < self.settings.http_error_rate:
            return "error"
        if draw < self.settings.http_error_rate + self.settings.stall_rate:
            return "stall"
        return None


def _prompt_tokens(body: dict) -> int:
    chars = len(json.dumps(body.get("tools") or []))
    for message in body["messages"]:
        content = message.get("content")
        chars += len(content if isinstance(content, str) else json.dumps(content or ""))
        chars += len(json.dumps(message.get("tool_calls") or []))
    return max(1, chars // 4)


def _pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [words[0]] + [" " + word for word in words[1:]]


def _tool_call_objects(answer: Answer) -> list[dict]:
    return [
        {
            "id": f"call_{answer.ident}_{index}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for index, (name, arguments) in enumerate(answer.tool_calls)
    ]


def _completion_tokens(answer: Answer) -> int:
    tokens = len(_pieces(answer.content)) if answer.content else 0
    return tokens + sum(max(1, len(a) // 4) for _, a in answer.tool_calls)


class Metrics:
    """What the mock's /metrics shows: the counters of a server with the sanitizer on or off, and
    the NIXL control-thread events, which (as under upstream's multiprocess collector) have no
    sample until something is counted."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.registry = prometheus_client.CollectorRegistry()
        self.nixl = prometheus_client.Counter(
            NIXL_METRIC,
            "NIXL connector control-thread events",
            ["thread", "event"],
            registry=self.registry,
        )
        self.sanitizer = None
        if settings.sanitizer or settings.sanitizer_violations:
            self.sanitizer = prometheus_client.Counter(
                SANITIZER_METRIC,
                "DeepSeek-V4 KV sanitizer violations",
                ["kind"],
                registry=self.registry,
            )
            for kind in SANITIZER_KINDS:
                self.sanitizer.labels(kind=kind)

    def answered(self, stats: Counter) -> None:
        """Count the faults this mock was told to show, as one chat answer goes out."""
        for kind in self.settings.sanitizer_violations:
            self.sanitizer.labels(kind=kind).inc()
            stats[f"sanitizer:{kind}"] += 1
        if self.settings.nixl_death and not stats["nixl_deaths"]:
            self.nixl.labels(thread=self.settings.nixl_death, event="death").inc()
            stats["nixl_deaths"] += 1

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def build_app(settings: Settings) -> web.Application:
    model = MockModel(settings)
    metrics = Metrics(settings)

    async def health(request: web.Request) -> web.Response:
        if settings.unhealthy:
            return web.Response(status=503, text="unhealthy")
        if request.path == "/health_generate":
            await asyncio.sleep(settings.ttft)
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": settings.model, "object": "model", "owned_by": "mock"}],
            }
        )

    async def stats(request: web.Request) -> web.Response:
        injected = {kind: model.stats[f"injected:{kind}"] for kind in KINDS}
        return web.json_response(
            {
                "requests": model.stats["requests"],
                "responses": model.stats["responses"],
                "http_errors": model.stats["http_errors"],
                "stalls": model.stats["stalls"],
                "injected": injected,
                "injected_with_tools": model.stats["injected_with_tools"],
                "sanitizer_violations": {
                    kind: model.stats[f"sanitizer:{kind}"] for kind in SANITIZER_KINDS
                },
                "nixl_deaths": model.stats["nixl_deaths"],
            }
        )

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "request body is not JSON")
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("messages"), list)
            or not body["messages"]
        ):
            return _error(400, "messages must be a non-empty list")
        model.stats["requests"] += 1
        fault = model.fault()
        if fault == "error":
            model.stats["http_errors"] += 1
            status = model.faults.choice((500, 503, 429))
            return _error(status, f"injected HTTP {status}")
        if fault == "stall":
            model.stats["stalls"] += 1
            await asyncio.sleep(settings.stall_seconds)
        itl = settings.itl
        if settings.slow_after is not None and model.stats["requests"] > settings.slow_after:
            itl = settings.slow_itl
        answer = model.answer(body)
        if answer.injected:
            model.stats[f"injected:{answer.injected}"] += 1
            # Tool-using clients (the soak) apart from the rest (bench_serving), which share a run.
            model.stats["injected_with_tools"] += bool(body.get("tools"))
        usage = {
            "prompt_tokens": _prompt_tokens(body),
            "completion_tokens": _completion_tokens(answer),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            response = await _stream(request, answer, usage if include_usage else None, itl)
        else:
            await asyncio.sleep(settings.ttft + itl * usage["completion_tokens"])
            response = web.json_response(_completion(answer, usage))
        model.stats["responses"] += 1
        metrics.answered(model.stats)
        return response

    def _completion(answer: Answer, usage: dict) -> dict:
        message = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            message["tool_calls"] = _tool_call_objects(answer)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": settings.model,
            "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason}],
            "usage": usage,
        }

    async def _stream(
        request: web.Request, answer: Answer, usage: dict | None, itl: float
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk_id = f"chatcmpl-{uuid.uuid4().hex[:16]}"

        async def send(delta: dict, finish_reason: str | None = None, pause: float = 0.0) -> None:
            await asyncio.sleep(pause)
            chunk = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": settings.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""}, pause=settings.ttft)
        for piece in _pieces(answer.content) if answer.content else []:
            await send({"content": piece}, pause=itl)
        for index, call in enumerate(_tool_call_objects(answer)):
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            await send({"tool_calls": [head]}, pause=itl)
            arguments = call["function"]["arguments"]
            for start in range(0, len(arguments), 16):
                piece = {"index": index, "function": {"arguments": arguments[start : start + 16]}}
                await send({"tool_calls": [piece]}, pause=itl)
        await send({}, finish_reason=answer.finish_reason)
        if usage is not None:
            tail = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": settings.model,
                "choices": [],
                "usage": usage,
            }
            await response.write(f"data: {json.dumps(tail)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(client_max_size=256 * 1024**2)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/mock/stats", stats)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m support.mock_server",
        formatter_class=DefaultsHelpFormatter,
        description="OpenAI-compatible mock of a tool-using model on 127.0.0.1, with injected faults.",
    )
    parser.add_argument("--port", type=int, default=8123, help="0 picks a free port (default 8123)")
    parser.add_argument("--model", default="mock-dsv4", help="model id it reports")
    parser.add_argument("--seed", type=int, default=0)
    for kind, flag in RATE_FLAGS.items():
        parser.add_argument(
            flag,
            type=rate,
            default=0.0,
            dest=f"rate_{kind}",
            help=f"share of answers corrupted with {kind}",
        )
    parser.add_argument(
        "--http-error-rate", type=rate, default=0.0, help="share answered 500/503/429"
    )
    parser.add_argument(
        "--stall-rate", type=rate, default=0.0, help="share held for --stall-seconds first"
    )
    parser.add_argument(
        "--stall-seconds", type=seconds, default=30.0, help="how long an injected stall lasts"
    )
    parser.add_argument("--ttft", type=seconds, default=0.0, help="seconds before the first token")
    parser.add_argument("--itl", type=seconds, default=0.0, help="seconds between streamed tokens")
    parser.add_argument("--unhealthy", action="store_true", help="answer /health with 503")
    parser.add_argument(
        "--sanitizer",
        action="store_true",
        help=f"/metrics shows {SANITIZER_METRIC} (the sanitizer is on), every kind at 0",
    )
    parser.add_argument(
        "--sanitizer-violation",
        action="append",
        default=[],
        choices=SANITIZER_KINDS,
        metavar="KIND",
        help="count one sanitizer violation of KIND with every chat answer (implies --sanitizer)",
    )
    parser.add_argument(
        "--nixl-death",
        choices=("prefill_bootstrap", "decode_listener"),
        metavar="THREAD",
        help=f"count one death of this NIXL control thread in {NIXL_METRIC} at the first chat answer",
    )
    parser.add_argument(
        "--slow-after",
        type=int,
        default=None,
        metavar="N",
        help="slow down after N chat requests: later ones stream --slow-itl apart",
    )
    parser.add_argument(
        "--slow-itl", type=seconds, default=0.05, help="seconds between tokens once slow"
    )
    parser.add_argument(
        "--exit-after",
        type=seconds,
        default=0.0,
        help="stop after this many seconds (0: run until stopped)",
    )
    return parser


async def serve(settings: Settings, port: int, exit_after: float) -> None:
    runner = web.AppRunner(build_app(settings), access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    await web.SockSite(runner, sock).start()
    print(f"mock server listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    try:
        if exit_after:
            await asyncio.sleep(exit_after)
        else:
            await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rates = {kind: getattr(args, f"rate_{kind}") for kind in KINDS}
    if sum(rates.values()) > 1.0:
        parser.error("the corruption rates add up to more than 1")
    if args.http_error_rate + args.stall_rate > 1.0:
        parser.error("--http-error-rate and --stall-rate add up to more than 1")
    settings = Settings(
        model=args.model,
        seed=args.seed,
        rates=rates,
        http_error_rate=args.http_error_rate,
        stall_rate=args.stall_rate,
        stall_seconds=args.stall_seconds,
        ttft=args.ttft,
        itl=args.itl,
        unhealthy=args.unhealthy,
        sanitizer=args.sanitizer,
        sanitizer_violations=tuple(args.sanitizer_violation),
        nixl_death=args.nixl_death,
        slow_after=args.slow_after,
        slow_itl=args.slow_itl,
    )
    try:
        asyncio.run(serve(settings, args.port, args.exit_after))
    except OSError as exc:
        print(
            f"mock server: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        pass
    return 0


@contextlib.contextmanager
def running(*options: str, startup_timeout: float = 60.0, lifetime: float = 600.0):
    """Run the mock server in a child process for the duration of a `with` block; yields its URL.

    `lifetime` bounds the child even if this process dies without stopping it."""
    command = [
        sys.executable,
        "-m",
        "support.mock_server",
        "--port",
        "0",
        "--exit-after",
        str(lifetime),
        *options,
    ]
    child = subprocess.Popen(command, cwd=TEST_DIR, stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            ready = selector.select(timeout=startup_timeout)
        line = child.stdout.readline() if ready else ""
        if not line.startswith("mock server listening on "):
            raise RuntimeError(
                f"mock server did not start (exit code {child.poll()}): {line.strip()!r}"
            )
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()


def read_stats(base_url: str) -> dict:
    """What the mock server injected so far (GET /mock/stats)."""
    with urllib.request.urlopen(f"{base_url}/mock/stats", timeout=10) as response:
        return json.load(response)


if __name__ == "__main__":
    sys.exit(main())
