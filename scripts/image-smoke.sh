#!/usr/bin/env bash
# The image built and run for real on a machine without a GPU: docker/Dockerfile built on a
# stand-in for the CUDA base (Debian bookworm from mmdebstrap: the CUDA base cannot be pulled
# here), its strict status check, then the tiny DeepSeek-V4 served by a prefill and a decode
# container on `--device cpu` with the router container in front, as docker/README.md runs them
# minus the GPU flags, and one chat completion through the router. Exit 0 only if every step
# held; each step's seconds are printed at the end, on a failure too.
#
# What the CPU run needs that a GPU image does not is set at run time, never in a second
# Dockerfile: `--device cpu` in EXTRA_ARGS. torch's CUDA build (the image's) runs on the CPU.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: scripts/image-smoke.sh [--work DIR] [--keep]

  --work DIR   where the base's rootfs, the tiny model and the container logs go
               (default: build/image-smoke)
  --keep       leave the containers running at the end (default: stopped and removed)

Needs podman and mmdebstrap (Debian: apt-get install podman runc mmdebstrap), run as root.
CONTAINERS_CONF defaults to docker/containers.conf (runc, cgroupfs, ulimits this machine allows).
pip in the build trusts $PIP_CERT (or pip's configured cert) if set: a TLS-inspecting proxy's CA.
EOF
}

repo=$(cd "$(dirname "$0")/.." && pwd)
work=$repo/build/image-smoke
keep=0
while (($#)); do
	case $1 in
	--work)
		(($# >= 2)) || { echo "image-smoke: --work needs a value" >&2; exit 2; }
		work=$2
		shift 2
		;;
	--keep) keep=1; shift ;;
	-h | --help) usage; exit 0 ;;
	*) echo "image-smoke: unknown argument '$1' (--help lists the options)" >&2; exit 2 ;;
	esac
done

export CONTAINERS_CONF=${CONTAINERS_CONF:-$repo/docker/containers.conf}
base=localhost/sglang-dsv4-standin-base:bookworm
image=localhost/sglang-dsv4-sm120:smoke
prefix=sglang-dsv4-smoke
containers=("$prefix-prefill" "$prefix-decode" "$prefix-router")
# A hang guard, no more: on this 2-core machine each server answers within about a minute.
start_timeout_s=${IMAGE_SMOKE_START_TIMEOUT:-900}

step_names=()
step_seconds=()
step_now=""
step_since=0
failed=""

say() { printf 'image-smoke: %s\n' "$*" >&2; }

step() { # NAME: the previous step held, NAME starts
	if [[ -n $step_now ]]; then
		step_names+=("$step_now")
		step_seconds+=($((SECONDS - step_since)))
		say "$step_now: ok ($((SECONDS - step_since)) s)"
	fi
	step_now=$1
	step_since=$SECONDS
	[[ -z $1 ]] || say "$1 ..."
}

fail() { # WHY
	failed="$step_now: $1"
	say "FAILED $failed"
	exit 1
}

container_logs() { # NAME: its log into the work folder, and its tail on stderr
	podman logs "$1" >"$work/$1.log" 2>&1 || true
	tail -n 25 "$work/$1.log" | sed -e "s/\x1b\[[0-9;]*m//g" -e "s/^/  $1| /" >&2
}

finish() {
	local rc=$? name i
	if [[ -n $failed || $rc -ne 0 ]]; then
		for name in "${containers[@]}"; do
			if podman container exists "$name" 2>/dev/null; then container_logs "$name"; fi
		done
	elif [[ -n $step_now ]]; then
		step ""
	fi
	if ((keep == 0)); then
		for name in "${containers[@]}"; do podman rm -f -t 5 "$name" >/dev/null 2>&1 || true; done
	fi
	echo "image-smoke: step seconds"
	for i in "${!step_names[@]}"; do
		printf 'image-smoke:   %-22s %6d\n' "${step_names[$i]}" "${step_seconds[$i]}"
	done
	[[ -z $failed ]] || printf 'image-smoke:   %-22s %6s  (%s)\n' "$step_now" failed "$failed"
	printf 'image-smoke:   %-22s %6d  (exit %d)\n' total "$SECONDS" "$rc"
}
trap finish EXIT

free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

for tool in podman mmdebstrap python3 curl; do
	command -v "$tool" >/dev/null || {
		say "$tool is missing: apt-get install podman runc mmdebstrap python3 curl"
		exit 2
	}
done
mkdir -p "$work"
# Absolute: podman reads a relative `-v` source as the name of a volume.
work=$(cd "$work" && pwd)
for name in "${containers[@]}"; do podman rm -f -t 5 "$name" >/dev/null 2>&1 || true; done

step base
# The stand-in for nvidia/cuda: Debian with Python, what the Dockerfile's apt steps build on. A
# fixed SOURCE_DATE_EPOCH makes the tarball the same bytes for the same packages, so a rerun
# reuses the layers above it.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1704067200} mmdebstrap --quiet --variant=minbase \
	--include=python3 bookworm "$work/rootfs.tar" || fail "mmdebstrap could not write the base"
printf 'FROM scratch\nADD rootfs.tar /\nCMD ["python3"]\n' >"$work/Containerfile.base"
podman build --quiet -f "$work/Containerfile.base" -t "$base" "$work" >/dev/null ||
	fail "podman could not import the base"

step build
# Dangling layers of this image's earlier builds (left when the pins changed), not its cache.
podman image prune -f --filter label=org.opencontainers.image.title=sglang-dsv4-sm120 >/dev/null
build=("$repo/scripts/build-image.sh" --builder podman --base "$base" --tag "$image" --network host)
pip_cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
[[ -z $pip_cert ]] || build+=(--ca-bundle "$pip_cert")
"${build[@]}" 2>&1 | tee "$work/build.log" | grep --line-buffered -E '^(STEP|\[|build-image|image )' >&2 ||
	true
[[ ${PIPESTATUS[0]} -eq 0 ]] || fail "the image did not build (log: $work/build.log)"
built=$(tail -n 1 "$work/build.log")
say "$built"

step status
# `docker run --rm sglang-dsv4-sm120 status --strict`: every fix applies in the image.
podman run --rm --no-healthcheck "$image" status --strict >"$work/status.log" 2>&1 ||
	{ cat "$work/status.log" >&2; fail "status --strict failed in the image"; }
sed 's/^/  status| /' "$work/status.log" >&2

step tiny-model
rm -rf "$work/model"
install -d -m 0777 "$work/model"
podman run --rm --no-healthcheck --entrypoint sglang-dsv4 -v "$work/model:/out" "$image" tiny-model --out /out \
	>"$work/tiny-model.log" 2>&1 || { cat "$work/tiny-model.log" >&2; fail "tiny-model failed"; }

step serve
prefill_port=$(free_port)
decode_port=$(free_port)
bootstrap_port=$(free_port)
router_port=$(free_port)
# The suite's CPU pool sizes (test/support/live.py): on the CPU upstream would size the pools
# from the host's free memory, for each server.
# A decode-log line per step: with a few tokens upstream's default (every 40) would log none.
cpu_args="--device cpu --max-total-tokens 131072 --swa-full-tokens-ratio 0.25 --max-running-requests 64"
cpu_args+=" --decode-log-interval 1"
# As docker/README.md runs them, minus --gpus and --ulimit memlock=-1 (RDMA registration only;
# this host's hard limit refuses it): host network, host IPC, the weights mounted read-only.
# The image's HEALTHCHECK is run by the wait below (`podman healthcheck run`): podman's own timer
# needs systemd, which this host does not run.
server=(podman run -d --health-interval disable --network host --ipc host -v "$work/model:/model:ro"
	-e MODEL_PATH=/model -e TP=1 -e HF_HUB_OFFLINE=1 -e "EXTRA_ARGS=$cpu_args")
"${server[@]}" --name "$prefix-prefill" -e "PORT=$prefill_port" -e "NCCL_PORT=$(free_port)" \
	-e "DISAGG_BOOTSTRAP_PORT=$bootstrap_port" "$image" prefill >/dev/null ||
	fail "the prefill container did not start"
"${server[@]}" --name "$prefix-decode" -e "PORT=$decode_port" -e "NCCL_PORT=$(free_port)" \
	"$image" decode >/dev/null || fail "the decode container did not start"
# The router looks for its workers every second (its default is 30) and keeps its metrics off
# the default port 29000, which anything else on the host may hold.
podman run -d --health-interval disable --name "$prefix-router" --network host \
	-e "PREFILL_URLS=http://127.0.0.1:$prefill_port@$bootstrap_port" \
	-e "DECODE_URLS=http://127.0.0.1:$decode_port" -e "PORT=$router_port" \
	-e "EXTRA_ARGS=--worker-startup-check-interval 1 --prometheus-host 127.0.0.1 --prometheus-port $(free_port)" \
	"$image" router >/dev/null || fail "the router container did not start"

# Ready when the image's HEALTHCHECK passes in all three containers (each probes the /health of
# the server it started) and the router has both servers as healthy workers; a container that
# exits ends the wait at once.
running() { [[ $(podman inspect --format '{{.State.Running}}' "$1" 2>/dev/null) == true ]]; }
healthy() { podman healthcheck run "$1" >/dev/null 2>&1; }
healthy_workers() {
	curl -fsS --max-time 10 "http://127.0.0.1:$router_port/readiness" 2>/dev/null |
		python3 -c 'import json, sys; print(json.load(sys.stdin).get("healthy_workers", 0))' 2>/dev/null ||
		echo 0
}
deadline=$((SECONDS + start_timeout_s))
while :; do
	for name in "${containers[@]}"; do
		running "$name" || fail "$name exited before the deployment was ready"
	done
	if healthy "$prefix-prefill" && healthy "$prefix-decode" && healthy "$prefix-router" &&
		(($(healthy_workers) >= 2)); then
		break
	fi
	((SECONDS < deadline)) || fail "not ready within ${start_timeout_s} s"
	sleep 1
done

step completion
# Where each container's log stands before the request, so what follows is the request's.
declare -A marks
for name in "${containers[@]}"; do marks[$name]=$(podman logs "$name" 2>&1 | wc -l); done
request='{"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}'
curl -fsS --max-time 300 -H 'Content-Type: application/json' -d "$request" \
	"http://127.0.0.1:$router_port/v1/chat/completions" >"$work/completion.json" ||
	fail "the chat completion through the router failed"
python3 - "$work/completion.json" <<'PY' >&2 || fail "the completion is not a chat completion with tokens"
import json
import sys

reply = json.load(open(sys.argv[1]))
choice = reply["choices"][0]
tokens = reply["usage"]["completion_tokens"]
assert tokens > 0 and choice["finish_reason"] in ("stop", "length"), reply
print(f"  completion| {tokens} tokens, finish {choice['finish_reason']}: {choice['message']['content']!r}")
PY
# The request crossed all three: what each container logged from the request on (ANSI colours
# off): the router forwarded it, the prefill container prefilled its prompt_tokens, the decode
# container decoded and answered.
crossed() { # NAME PATTERN WHAT: the log lines since the mark that match, printed
	local lines
	lines=$(podman logs "$1" 2>&1 | tail -n +"$((${marks[$1]} + 1))" | sed 's/\x1b\[[0-9;]*m//g' |
		grep -E "$2" || true)
	[[ -n $lines ]] || fail "$1 logged no $3 for the completion"
	tail -n 2 <<<"$lines" | cut -c 1-220 | sed "s/^/  $1| /" >&2
}
prompt_tokens=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["usage"]["prompt_tokens"])' \
	"$work/completion.json")
crossed "$prefix-router" 'uri=/v1/chat/completions.*status_code=200' "forwarded request"
crossed "$prefix-prefill" "Prefill batch.*#new-token: $prompt_tokens," "prefill of the prompt"
crossed "$prefix-decode" 'Decode batch' "decode step"
crossed "$prefix-decode" '"POST /v1/chat/completions HTTP/1.1" 200' "answer"

step liveness
# The operator's liveness tool, from the image itself: health and one generation per server.
podman run --rm --no-healthcheck --network host --entrypoint sglang-dsv4 "$image" liveness \
	--prefill "http://127.0.0.1:$prefill_port" --decode "http://127.0.0.1:$decode_port" \
	--router "http://127.0.0.1:$router_port" >"$work/liveness.log" 2>&1 ||
	{ cat "$work/liveness.log" >&2; fail "liveness from the image failed"; }
sed 's/^/  liveness| /' "$work/liveness.log" >&2

step stop
if ((keep == 0)); then
	for name in "${containers[@]}"; do
		podman stop -t 20 "$name" >/dev/null || fail "$name did not stop"
		podman rm "$name" >/dev/null
	done
fi
