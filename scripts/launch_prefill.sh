#!/usr/bin/env bash
# The prefill role on bare metal: the container entrypoint's own mapping of environment variables
# to upstream's command (docker/entrypoint.sh --help lists them). Usage: launch_prefill.sh [--dry-run] [ARGS...]
set -euo pipefail
exec "$(dirname "$(readlink -f "$0")")/../docker/entrypoint.sh" prefill "$@"
