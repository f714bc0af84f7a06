#!/usr/bin/env bash
# The decode role on bare metal: the container entrypoint's own mapping of environment variables
# to upstream's command (docker/entrypoint.sh --help lists them). Usage: launch_decode.sh [--dry-run] [ARGS...]
set -euo pipefail
exec "$(dirname "$(readlink -f "$0")")/../docker/entrypoint.sh" decode "$@"
