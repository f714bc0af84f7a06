"""The four ways a DeepSeek-V4 tool-using response comes back corrupted, and a checker for each.

- dsml_leak: complete DSML tool-call markup in the text (content or a call's arguments) instead
  of parsed `tool_calls`.
- truncated_markup: DSML that is cut off, unbalanced or garbled (a leak that did not even close).
- malformed_tool_call: a parsed call to a function the request did not offer, arguments that are
  not a JSON object, or a required parameter missing.
- repetition: a degenerate loop, the same run of words (or characters) over and over.

A response may show several kinds; it counts once as corrupt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sglang_dsv4.acceptance import dsml

KINDS = ("dsml_leak", "truncated_markup", "malformed_tool_call", "repetition")

# A loop is a unit of up to 20 words repeated at least 5 times in a row over 30+ words, or
# (for text without spaces) a unit of up to 40 characters repeated 10+ times over 120+ characters.
# Ordinary prose, lists and code stay far below both.
_WORD_LOOP = re.compile(r"((?:\S+ ){1,20}?)\1{4,}")
_CHAR_LOOP = re.compile(r"(.{1,40}?)\1{9,}", re.DOTALL)
MIN_LOOP_WORDS = 30
MIN_LOOP_CHARS = 120


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    id: str = ""


def repetition_loop(text: str) -> str | None:
    """The looping unit, when the text degenerates into a loop."""
    words = " ".join(text.split()) + " "
    for match in _WORD_LOOP.finditer(words):
        if len(match.group(0).split()) >= MIN_LOOP_WORDS:
            return match.group(1).strip()
    for match in _CHAR_LOOP.finditer(text):
        if len(match.group(0)) >= MIN_LOOP_CHARS:
            return match.group(1)
    return None


def _markup_findings(where: str, text: str) -> list[Finding]:
    markup = dsml.scan(text)
    if markup is None:
        return []
    if markup.complete:
        return [Finding("dsml_leak", f"{markup.tags} DSML tags in {where}")]
    return [Finding("truncated_markup", f"{where}: {markup.problem}")]


def _strings(arguments: str) -> list[str]:
    """The text inside a call's arguments: its string values once decoded (JSON escapes would hide
    the markup), or the raw text when it is not JSON."""
    try:
        stack = [json.loads(arguments)]
    except (json.JSONDecodeError, TypeError):
        return [arguments or ""]
    strings = []
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return strings


def _call_problem(call: ToolCall, tools: dict[str, dict]) -> str | None:
    schema = tools.get(call.name)
    if schema is None:
        return f"unknown function {call.name!r}"
    try:
        arguments = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        return f"{call.name}: arguments are not valid JSON: {str(call.arguments)[:60]!r}"
    if not isinstance(arguments, dict):
        return f"{call.name}: arguments are not a JSON object"
    missing = [name for name in schema.get("required", ()) if name not in arguments]
    if missing:
        return f"{call.name}: missing required {', '.join(missing)}"
    return None


def check_response(
    content: str | None, tool_calls: list[ToolCall], tools: dict[str, dict]
) -> list[Finding]:
    """Every corruption in one assistant response; `tools` maps each offered function's name to
    its JSON-schema `parameters`."""
    findings = _markup_findings("content", content or "")
    texts = [content or ""]
    for call in tool_calls:
        strings = _strings(call.arguments)
        texts += strings
        findings += _markup_findings(f"{call.name or '?'} arguments", "\n".join(strings))
        problem = _call_problem(call, tools)
        if problem:
            findings.append(Finding("malformed_tool_call", problem))
    for text in texts:
        unit = repetition_loop(text)
        if unit is not None:
            findings.append(Finding("repetition", f"loop of {unit[:60]!r}"))
            break
    return findings
