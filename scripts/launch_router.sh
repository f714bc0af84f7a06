#!/usr/bin/env bash
# The router role on bare metal: the container entrypoint's own mapping of environment variables
# to upstream's command (docker/entrypoint.sh --help lists them). Usage: launch_router.sh [--dry-run] [ARGS...]
set -euo pipefail
exec "$(dirname "$(readlink -f "$0")")/../docker/entrypoint.sh" router "$@"
