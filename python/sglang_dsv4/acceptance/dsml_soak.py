"""DSML tool-call corruption soak: many long agent sessions at once, every answer checked.

    sglang-dsv4 soak --base-url http://router:8000 --sessions 64 \\
        --target-context 80000 --json soak.json --examples soak-bad.jsonl

Each session is a coding agent with five tools. It sends a task, executes every tool call it gets
back (with made-up but realistic results: file contents, search hits, command logs) and feeds the
results back; when the model answers in prose it gets a follow-up message carrying pasted
material. Both are sized so that the prompt grows to --target-context tokens over --turns
requests (sizes are corrected by the prompt_tokens the server reports). Every assistant response
is checked for the kinds in sglang_dsv4.acceptance.corruption. HTTP errors, timeouts and broken streams count
as errors, never as corruption, and the client does not retry (a retry would hide them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sglang_dsv4.acceptance.arg_types import (
    DefaultsHelpFormatter,
    positive_float,
    positive_int,
    rate,
)
from sglang_dsv4.acceptance.corruption import KINDS, ToolCall, check_response

Z95 = 1.959964  # two-sided 95 % normal quantile

# Prompt sizes are bucketed by these upper edges (tokens).
BUCKET_EDGES = (4_000, 8_000, 16_000, 32_000, 64_000)


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS = [
    _function(
        "read_file",
        "Read a text file of the repository.",
        {
            "path": {"type": "string", "description": "path from the repository root"},
            "start_line": {"type": "integer", "description": "first line to return, from 1"},
            "max_lines": {"type": "integer", "description": "how many lines to return"},
        },
        ["path"],
    ),
    _function(
        "search_code",
        "Search the repository for a regular expression.",
        {
            "query": {"type": "string", "description": "regular expression"},
            "path": {"type": "string", "description": "directory to search in"},
            "max_results": {"type": "integer"},
        },
        ["query"],
    ),
    _function(
        "run_command",
        "Run a shell command in the repository and return its output.",
        {
            "command": {"type": "string"},
            "timeout_seconds": {"type": "integer"},
        },
        ["command"],
    ),
    _function(
        "list_directory",
        "List the files under a directory.",
        {"path": {"type": "string"}, "recursive": {"type": "boolean"}},
        ["path"],
    ),
    _function(
        "write_file",
        "Replace the contents of a file.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
        ["path", "content"],
    ),
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

SYSTEM_PROMPT = (
    "You are a careful software engineer working in a Python repository through tools. Inspect "
    "before you change anything: read the files involved, search for every caller, run the tests. "
    "Call tools whenever they help; when you have enough, explain what you found and what you "
    "would change, briefly, then continue with the next step."
)
TASKS = (
    "The test suite fails in the cache module since yesterday's merge. Find out why.",
    "Requests time out under load when the router retries. Track down where the retry loop is.",
    "Add a --dry-run flag to the command line tool and make sure the tests cover it.",
    "The decode worker leaks memory after long sessions. Find what keeps references alive.",
    "Profile the request parser; it is the top entry in the latency breakdown.",
    "Review the last three commits for thread-safety problems in the scheduler.",
)
FOLLOW_UPS = (
    "Here is the CI log from the last run. What does it tell you?",
    "A colleague pasted this stack trace from production. Is it the same problem?",
    "This is the current version of the module after my edits. Check it again.",
    "Here is the benchmark output from this morning. Anything suspicious?",
)

NAMES = (
    "cache request batch token page prefix decode prefill router queue worker buffer index "
    "schedule session config stream result offset window metric handler retry parser"
).split()
VERBS = "get set load save parse build check update flush merge split read write send".split()
MODULES = ("core", "io", "net", "cache", "cli", "model", "utils", "sched")


def _code_line(rng: random.Random) -> str:
    name, other = rng.choice(NAMES), rng.choice(NAMES)
    return rng.choice(
        (
            f"def {rng.choice(VERBS)}_{name}(self, {other}, limit={rng.randint(1, 512)}):",
            f"    {name} = self.{other}s.get({other}.id)",
            f"    if {name} is None:",
            f'        raise KeyError(f"no {name} for {{{other}.id}}")',
            f"    for {other} in self.{name}_{other}s[:limit]:",
            f"        self._{rng.choice(VERBS)}({other}, {name})",
            f"    return {name}.{rng.choice(VERBS)}({other})",
            f"class {name.title()}{other.title()}:",
            f"    # keeps {name} in step with {other}; see {rng.choice(MODULES)}/{other}.py",
        )
    )


def _log_line(rng: random.Random) -> str:
    stamp = f"12:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}"
    module, name = rng.choice(MODULES), rng.choice(NAMES)
    return rng.choice(
        (
            f"{stamp} INFO  {module}.{name}: {rng.choice(VERBS)} {rng.randint(1, 9999)} {name}s in {rng.randint(1, 900)} ms",
            f"{stamp} WARN  {module}.{name}: {name} queue at {rng.randint(50, 100)} % of capacity",
            f"{stamp} ERROR {module}.{name}: {rng.choice(VERBS)}_{name} failed: timeout after {rng.randint(1, 60)} s",
            f"FAILED tests/test_{module}.py::test_{rng.choice(VERBS)}_{name} - AssertionError: {rng.randint(0, 99)} != {rng.randint(100, 999)}",
            f"tests/test_{module}.py::test_{name}_{rng.choice(NAMES)} PASSED",
        )
    )


def material(rng: random.Random, tool: str, chars: int) -> str:
    """Text about `chars` long that looks like what `tool` returns."""
    lines: list[str] = []
    size = 0
    while size < chars:
        if tool in ("read_file", "write_file"):
            line = _code_line(rng)
        elif tool == "search_code":
            line = f"src/{rng.choice(MODULES)}/{rng.choice(NAMES)}.py:{rng.randint(1, 900)}:{_code_line(rng)}"
        elif tool == "list_directory":
            line = f"src/{rng.choice(MODULES)}/{rng.choice(NAMES)}_{rng.choice(NAMES)}.py  {rng.randint(200, 90000)} bytes"
        else:
            line = _log_line(rng)
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


@dataclass
class Reply:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    prompt_tokens: int | None


@dataclass
class Share:
    responses: int = 0
    corrupt: int = 0


@dataclass
class Tally:
    requests: int = 0
    responses: int = 0
    corrupt: int = 0
    errors: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    buckets: dict = field(default_factory=dict)
    modes: dict = field(default_factory=dict)
    max_context: int = 0
    estimated_contexts: int = 0
    sessions_done: int = 0
    stopped_by_deadline: bool = False


def bucket_of(tokens: int) -> str:
    lower = 0
    for edge in BUCKET_EDGES:
        if tokens < edge:
            return f"{lower // 1000}k-{edge // 1000}k"
        lower = edge
    return f">={lower // 1000}k"


def bucket_labels() -> list[str]:
    return [bucket_of(edge - 1) for edge in BUCKET_EDGES] + [bucket_of(BUCKET_EDGES[-1])]


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    return max(0.0, centre - half), min(1.0, centre + half)


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, openai.APITimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, httpx.HTTPError):
        return "broken stream"
    return f"bad response ({type(exc).__name__})"


REQUEST_ERRORS = (
    openai.OpenAIError,
    httpx.HTTPError,
    TimeoutError,
    ValueError,
    KeyError,
    IndexError,
)


def _history_message(reply: Reply) -> dict:
    """The assistant message as an agent keeps it; arguments that are not JSON are replaced by {}
    so the server does not refuse the rest of the session."""
    message: dict = {"role": "assistant", "content": reply.content or ""}
    if reply.tool_calls:
        calls = []
        for call in reply.tool_calls:
            try:
                json.loads(call.arguments)
                arguments = call.arguments
            except (json.JSONDecodeError, TypeError):
                arguments = "{}"
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        message["tool_calls"] = calls
    return message


def _tool_result(rng: random.Random, call: ToolCall, chars: int) -> str:
    schema = TOOL_SCHEMAS.get(call.name)
    if schema is None:
        return f"error: there is no tool named {call.name!r}"
    try:
        arguments = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        return "error: the arguments are not valid JSON"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    missing = [name for name in schema["required"] if name not in arguments]
    if missing:
        return f"error: missing required parameter {missing[0]!r}"
    return material(rng, call.name, chars)


class Soak:
    def __init__(self, args: argparse.Namespace, client: openai.AsyncOpenAI):
        self.args = args
        self.client = client
        self.slots = asyncio.Semaphore(args.concurrency)
        self.tally = Tally()
        self.examples: list[dict] = []
        self.deadline = time.monotonic() + args.max_duration

    async def ask(self, messages: list[dict], stream: bool) -> Reply:
        request = {
            "model": self.args.model,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": self.args.max_tokens,
        }
        if self.args.temperature is not None:
            request["temperature"] = self.args.temperature
        async with self.slots:
            if stream:
                return await asyncio.wait_for(self._streamed(request), self.args.timeout)
            return await asyncio.wait_for(self._plain(request), self.args.timeout)

    async def _plain(self, request: dict) -> Reply:
        response = await self.client.chat.completions.create(**request)
        if not response.choices:
            raise ValueError("response without choices")
        choice = response.choices[0]
        calls = [
            ToolCall(
                name=c.function.name or "", arguments=c.function.arguments or "", id=c.id or ""
            )
            for c in choice.message.tool_calls or []
        ]
        usage = response.usage
        return Reply(
            choice.message.content, calls, choice.finish_reason, usage and usage.prompt_tokens
        )

    async def _streamed(self, request: dict) -> Reply:
        stream = await self.client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        content: list[str] = []
        calls: dict[int, dict] = {}
        finish_reason = prompt_tokens = None
        async for chunk in stream:
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content.append(delta.content)
                for piece in delta.tool_calls or []:
                    call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = piece.id or call["id"]
                    if piece.function is not None:
                        call["name"] += piece.function.name or ""
                        call["arguments"] += piece.function.arguments or ""
                finish_reason = choice.finish_reason or finish_reason
        tool_calls = [ToolCall(**calls[index]) for index in sorted(calls)]
        return Reply("".join(content) or None, tool_calls, finish_reason, prompt_tokens)

    def record(self, session: int, step: int, stream: bool, context: int, reply: Reply) -> None:
        tally = self.tally
        findings = check_response(reply.content, reply.tool_calls, TOOL_SCHEMAS)
        kinds = sorted({finding.kind for finding in findings})
        bucket = tally.buckets.setdefault(bucket_of(context), Share())
        mode = tally.modes.setdefault("stream" if stream else "plain", Share())
        tally.responses += 1
        bucket.responses += 1
        mode.responses += 1
        tally.max_context = max(tally.max_context, context)
        if kinds:
            tally.corrupt += 1
            bucket.corrupt += 1
            mode.corrupt += 1
            tally.kinds.update(kinds)
            self.examples.append(
                {
                    "session": session,
                    "step": step,
                    "mode": "stream" if stream else "plain",
                    "context_tokens": context,
                    "kinds": kinds,
                    "details": [finding.detail for finding in findings],
                    "finish_reason": reply.finish_reason,
                    "content": reply.content,
                    "tool_calls": [
                        {"name": c.name, "arguments": c.arguments} for c in reply.tool_calls
                    ],
                }
            )

    async def session(self, index: int, progress: Progress, task) -> None:
        args = self.args
        rng = random.Random(f"{args.seed}:{index}")
        stream = args.stream == "on" or (args.stream == "mixed" and index % 2 == 0)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": rng.choice(TASKS)},
        ]
        tokens_per_char = 0.25  # corrected from the server's prompt_tokens after each answer
        previous = padding = None
        organic = 0.0  # growth per step besides the padding: the answer, message framing
        done = 0
        for step in range(args.turns):
            if time.monotonic() >= self.deadline:
                self.tally.stopped_by_deadline = True
                break
            done += 1
            self.tally.requests += 1
            try:
                reply = await self.ask(messages, stream)
            except REQUEST_ERRORS as exc:
                self.tally.errors[_error_kind(exc)] += 1
                self._show(progress, task)
                continue  # the agent sends the same conversation again next turn
            chars = len(json.dumps(messages, ensure_ascii=False))
            if reply.prompt_tokens:
                context = reply.prompt_tokens
                tokens_per_char = context / chars
            else:
                context = int(chars * tokens_per_char)
                self.tally.estimated_contexts += 1
            if previous is not None:
                organic = max(0.0, context - previous - padding)
            self.record(index, step, stream, context, reply)
            self._show(progress, task)
            if context >= args.target_context:
                break
            # Spread what is left to the target over the requests left, so the last one is near it.
            turns_left = max(1, args.turns - step - 1)
            padding = max(0.0, (args.target_context - context) / turns_left - organic)
            previous = context
            self._continue(messages, reply, rng, int(padding / tokens_per_char), f"{index}_{step}")
        self.tally.sessions_done += 1
        progress.advance(task, args.turns - done)

    @staticmethod
    def _continue(messages: list, reply: Reply, rng: random.Random, chars: int, tag: str) -> None:
        """Append the answer and what the agent sends next: a result for each tool call, else a
        follow-up message with pasted material; `chars` of padding in all."""
        assistant = _history_message(reply)
        messages.append(assistant)
        if not reply.tool_calls:
            pasted = material(rng, rng.choice(list(TOOL_SCHEMAS)), chars)
            messages.append({"role": "user", "content": f"{rng.choice(FOLLOW_UPS)}\n\n{pasted}"})
            return
        for number, call in enumerate(reply.tool_calls):
            call_id = call.id or f"call_{tag}_{number}"
            assistant["tool_calls"][number]["id"] = call_id
            result = _tool_result(rng, call, chars // len(reply.tool_calls))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

    def _show(self, progress: Progress, task) -> None:
        tally = self.tally
        progress.update(
            task,
            advance=1,
            description=f"soak: corrupt {tally.corrupt}/{tally.responses}, errors {sum(tally.errors.values())}",
        )

    async def run(self, console: Console) -> None:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak", total=self.args.sessions * self.args.turns)
            await asyncio.gather(
                *(self.session(i, progress, task) for i in range(self.args.sessions))
            )


def _share(k: int, n: int) -> dict:
    low, high = wilson(k, n)
    return {"count": k, "of": n, "rate": k / n if n else None, "interval": [low, high]}


def summary(soak: Soak, seconds: float) -> dict:
    tally, args = soak.tally, soak.args
    n = tally.responses
    low, high = wilson(tally.corrupt, n)
    return {
        "requests": tally.requests,
        "responses": n,
        "corrupt": tally.corrupt,
        "corruption_rate": tally.corrupt / n if n else None,
        "corruption_interval": [low, high],
        "errors": sum(tally.errors.values()),
        "errors_by_type": dict(tally.errors),
        "by_kind": {kind: _share(tally.kinds[kind], n) for kind in KINDS},
        "by_context": {
            label: _share(tally.buckets[label].corrupt, tally.buckets[label].responses)
            for label in bucket_labels()
            if label in tally.buckets
        },
        "by_mode": {
            mode: _share(s.corrupt, s.responses) for mode, s in sorted(tally.modes.items())
        },
        "max_context_tokens": tally.max_context,
        "estimated_contexts": tally.estimated_contexts,
        "sessions": args.sessions,
        "sessions_finished": tally.sessions_done,
        "stopped_by_deadline": tally.stopped_by_deadline,
        "duration_s": round(seconds, 2),
        "config": {
            "base_url": args.base_url,
            "model": args.model,
            "turns": args.turns,
            "target_context": args.target_context,
            "concurrency": args.concurrency,
            "stream": args.stream,
            "seed": args.seed,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
        },
    }


def _percent(share: dict) -> tuple[str, str]:
    rate = "-" if share["rate"] is None else f"{100 * share['rate']:.2f} %"
    low, high = share["interval"]
    return rate, f"{100 * low:.2f} - {100 * high:.2f} %"


def print_report(report: dict, console: Console) -> None:
    overall = _share(report["corrupt"], report["responses"])
    rate, interval = _percent(overall)
    by_type = ", ".join(
        f"{kind}: {count}" for kind, count in sorted(report["errors_by_type"].items())
    )
    errors = f" ({by_type})" if by_type else ""
    console.print(
        f"[bold]DSML soak[/]: {report['responses']} responses checked from {report['requests']} "
        f"requests; {report['errors']} errors{errors}; largest prompt "
        f"{report['max_context_tokens']} tokens"
    )
    console.print(
        f"corrupt {report['corrupt']} of {report['responses']}: {rate} (95 % interval {interval})"
    )
    for title, rows in (
        ("kind", report["by_kind"]),
        ("prompt tokens", report["by_context"]),
        ("mode", report["by_mode"]),
    ):
        table = Table(title=f"corruption by {title}", title_justify="left")
        for column in (title, "corrupt", "responses", "rate", "95 % interval"):
            table.add_column(column, justify="left" if column == title else "right")
        for name, share in rows.items():
            table.add_row(name, str(share["count"]), str(share["of"]), *_percent(share))
        console.print(table)
    if report["stopped_by_deadline"]:
        console.print("[yellow]stopped at --max-duration before every session finished[/]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dsv4 soak",
        formatter_class=DefaultsHelpFormatter,
        description="Concurrent multi-turn tool-calling sessions; every answer checked for DSML "
        "leaks, truncated markup, malformed tool calls and repetition loops.",
    )
    parser.add_argument(
        "--base-url", required=True, help="OpenAI-compatible server, e.g. http://router:8000"
    )
    parser.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="default: $OPENAI_API_KEY, else EMPTY",
    )
    parser.add_argument(
        "--sessions", type=positive_int, default=64, help="concurrent tool-using sessions"
    )
    parser.add_argument(
        "--turns", type=positive_int, default=40, help="requests per session, at most"
    )
    parser.add_argument(
        "--target-context",
        type=positive_int,
        default=80_000,
        help="prompt tokens a session grows to (default 80000)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (default: one per session)",
    )
    parser.add_argument(
        "--stream",
        choices=("mixed", "on", "off"),
        default="mixed",
        help="mixed: even-numbered sessions stream, odd ones do not",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=1024, help="output tokens per answer, at most"
    )
    parser.add_argument("--temperature", type=float, default=None, help="default: the server's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--max-duration",
        type=positive_float,
        default=4 * 3600.0,
        help="seconds before no new request starts",
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--examples", metavar="OUT.jsonl", help="write each corrupt response")
    parser.add_argument(
        "--fail-above",
        type=rate,
        default=None,
        metavar="RATE",
        help="exit 3 when the corruption rate is above RATE (e.g. 0.001)",
    )
    return parser


async def _main(args: argparse.Namespace, console: Console) -> dict:
    client = openai.AsyncOpenAI(
        base_url=args.base_url.rstrip("/").removesuffix("/v1") + "/v1",
        api_key=args.api_key,
        max_retries=0,
        timeout=args.timeout,
    )
    async with client:
        if args.model is None:
            try:
                models = await client.models.list()
            except REQUEST_ERRORS as exc:
                raise SystemExit(
                    f"dsml_soak: cannot list models at {args.base_url}: {_error_kind(exc)}"
                ) from None
            if not models.data:
                raise SystemExit(f"dsml_soak: {args.base_url} serves no model; pass --model")
            args.model = models.data[0].id
        soak = Soak(args, client)
        started = time.monotonic()
        await soak.run(Console(stderr=True))
        report = summary(soak, time.monotonic() - started)
    if args.examples:
        with open(args.examples, "w") as out:
            for example in soak.examples:
                out.write(json.dumps(example, ensure_ascii=False) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url must start with http:// or https://, not {args.base_url!r}")
    args.concurrency = args.concurrency or args.sessions
    # Logs and CI are not terminals: wide enough for the tables, and no wrapped lines.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    report = asyncio.run(_main(args, console))
    print_report(report, console)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    if report["responses"] == 0:
        console.print(f"dsml_soak: no response to check: all {report['requests']} requests failed")
        return 1
    if args.fail_above is not None and report["corruption_rate"] > args.fail_above:
        console.print(
            f"dsml_soak: corruption rate {report['corruption_rate']:.4f} is above {args.fail_above}"
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
