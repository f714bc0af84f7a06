"""DeepSeek-V4 DSML tool-call markup: how it is written, and how to find it in text.

DeepSeek-V4 writes a tool call as DSML tags, which the server's tool-call parser (upstream:
sglang/srt/function_call/deepseekv4_detector.py) turns into `tool_calls`:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="read_file">
    <｜DSML｜parameter name="path" string="true">src/app.py</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The bars are U+FF5C (full width). Any of this reaching the client as text is a fault. V3.2 names
the outer block `function_calls` and V4.1 puts a space before each tag name, so the scanner accepts
any tag name after the marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MARKER = "\uff5cDSML\uff5c"
BLOCK = "tool_calls"

# One DSML tag: closing slash, name, attributes, self-closing slash.
_TAG = re.compile("<(/?)" + MARKER + r"\s?([A-Za-z_]+)([^<>]*?)(/?)>")


def render_tool_calls(calls: list[tuple[str, dict]]) -> str:
    """The DSML block a DeepSeek-V4 model writes for `calls` ([(name, arguments), ...])."""
    lines = [f"<{MARKER}{BLOCK}>"]
    for name, arguments in calls:
        lines.append(f'<{MARKER}invoke name="{name}">')
        for key, value in arguments.items():
            if isinstance(value, str):
                lines.append(
                    f'<{MARKER}parameter name="{key}" string="true">{value}</{MARKER}parameter>'
                )
            else:
                encoded = json.dumps(value, ensure_ascii=False)
                lines.append(
                    f'<{MARKER}parameter name="{key}" string="false">{encoded}</{MARKER}parameter>'
                )
        lines.append(f"</{MARKER}invoke>")
    lines.append(f"</{MARKER}{BLOCK}>")
    return "\n".join(lines)


@dataclass(frozen=True)
class Markup:
    """What DSML a text holds: `tags` well-formed tags; `complete` when they balance and nothing
    is cut off or garbled; `problem` says what is wrong otherwise."""

    tags: int
    complete: bool
    problem: str | None


def _dangling_tag(text: str) -> str | None:
    """A DSML tag cut off at the end of the text ('<｜DS', '</｜DSML｜inv', '<｜DSML｜invoke name="x')."""
    start = text.rfind("<")
    if start == -1 or ">" in text[start:]:
        return None
    tail = text[start:]
    for opener in ("<" + MARKER, "</" + MARKER):
        if tail.startswith(opener) or (len(tail) >= 2 and opener.startswith(tail)):
            return tail
    return None


def scan(text: str) -> Markup | None:
    """None when the text holds no DSML at all."""
    if not text:
        return None
    dangling = _dangling_tag(text)
    if MARKER not in text and dangling is None:
        return None
    matches = list(_TAG.finditer(text))
    open_tags: list[str] = []
    problem = None
    for match in matches:
        closing, name, _, self_closing = match.groups()
        if self_closing:
            continue
        if not closing:
            open_tags.append(name)
        elif open_tags and open_tags[-1] == name:
            open_tags.pop()
        else:
            problem = f"closing tag {name!r} without its opening tag"
            break
    if problem is None and dangling is not None:
        problem = f"tag cut off at the end: {dangling[:40]!r}"
    if problem is None and open_tags:
        problem = f"unclosed tag {open_tags[-1]!r}"
    # A marker outside any well-formed tag is markup the model garbled.
    if problem is None and text.count(MARKER) > sum(m.group(0).count(MARKER) for m in matches):
        problem = "DSML marker outside a well-formed tag"
    return Markup(tags=len(matches), complete=problem is None, problem=problem)
