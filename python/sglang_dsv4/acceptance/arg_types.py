"""Argument types the acceptance tools and the benchmarks share: argparse turns their errors into
one usage line."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds cannot be negative: {text}")
    return value


def rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate is between 0 and 1, not {text}")
    return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, unless its help names one already or it has none
    worth showing (unset, off, empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)
