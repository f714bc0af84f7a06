"""`python -m sglang_dsv4.envcheck [NAME=--flag ...]`: check settings before anything starts.

docker/entrypoint.sh runs it before it starts (or prints) a role: the distribution's variables
(`sglang_dsv4.settings`: index-K dtype, fix ids to skip), upstream's SGLANG_LOCAL_IP_NIC (only
with netifaces installed) and, for each NAME=--flag given whose
variable is set, that its value is one of the choices upstream's own parser
(`ServerArgs.add_cli_args`) allows for --flag. Upstream is imported only for the latter.
Exit 0, or 2 with one line naming the variable.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

from sglang_dsv4 import settings


class EnvError(ValueError):
    pass


@functools.cache
def _server_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def upstream_choices(flag: str) -> list[str]:
    """The values upstream's server parser accepts for `flag`."""
    for action in _server_parser()._actions:
        if flag in action.option_strings:
            if not action.choices:
                raise EnvError(f"upstream's {flag} takes any value; nothing to check it against")
            return [str(choice) for choice in action.choices]
    raise EnvError(f"upstream sglang has no flag {flag}")


def check(environ, pairs: list[str]) -> None:
    try:
        settings.from_environ(environ)
    except settings.SettingsError as exc:
        raise EnvError(str(exc)) from None
    # Upstream reads SGLANG_LOCAL_IP_NIC with netifaces, and without it fails only when a PD
    # connection is first made.
    if environ.get("SGLANG_LOCAL_IP_NIC") and importlib.util.find_spec("netifaces") is None:
        raise EnvError(
            "SGLANG_LOCAL_IP_NIC needs the netifaces package, which this environment lacks; "
            "set SGLANG_HOST_IP to the address to advertise instead"
        )
    for pair in pairs:
        name, sep, flag = pair.partition("=")
        if not sep or not flag.startswith("--"):
            raise EnvError(f"envcheck: expected NAME=--flag, got {pair!r}")
        value = environ.get(name, "")
        if not value:
            continue
        allowed = upstream_choices(flag)
        if value not in allowed:
            raise EnvError(
                f"{name}={value!r} is not one of upstream's choices for {flag}: {', '.join(allowed)}"
            )


def main(argv: list[str] | None = None) -> int:
    pairs = sys.argv[1:] if argv is None else argv
    try:
        check(os.environ, pairs)
    except EnvError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
