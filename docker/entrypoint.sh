#!/usr/bin/env bash
# sglang-dsv4-sm120 entrypoint: one image (or one bare-metal host) in the roles of a
# prefill-decode deployment over NIXL. It only maps documented environment variables to
# upstream's own launch commands; `entrypoint.sh --help` lists them. scripts/launch_*.sh run
# this same file on bare metal, so the mapping exists once.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: entrypoint.sh [--dry-run] ROLE [--dry-run] [ARGS...]

Roles
  prefill   python3 -m sglang.launch_server --disaggregation-mode prefill (NIXL transfer)
  decode    python3 -m sglang.launch_server --disaggregation-mode decode  (NIXL transfer)
  router    python3 -m sglang_router.launch_router --pd-disaggregation
  status    sglang-dsv4 status ARGS  (upstream pin, every fix and whether it is in force)
  plan      sglang-dsv4 plan ARGS    (per-rank memory plan; --model MODEL_PATH, --tp TP if set)
  health    exit 0 when the server this container started answers GET /health (HEALTHCHECK)

--dry-run prints the exact command and exits 0. ARGS after the role are appended to the
command, after EXTRA_ARGS; for upstream's flags a later flag wins over an earlier one.

prefill and decode
  MODEL_PATH              required: model folder (or Hugging Face id) to serve
  TP                      tensor-parallel size, GPUs per server (default 4)
  HOST                    address to listen on (default 0.0.0.0)
  PORT                    HTTP port (default: prefill 30000, decode 30001)
  DISAGG_BOOTSTRAP_PORT   prefill only: NIXL bootstrap port (default 8998)
  IB_DEVICE               RDMA devices for NIXL/UCX, e.g. mlx5_0 or mlx5_0,mlx5_1, no port suffix
                          (default: UCX picks)
  UCX_NET_DEVICES         UCX's own device list, e.g. mlx5_0:1 (passed through; upstream then
                          ignores IB_DEVICE, so setting both is refused)
  SGLANG_HOST_IP          upstream's: the address this server advertises to its PD peers
                          (passed through); set it on hosts with several NICs
  SGLANG_LOCAL_IP_NIC     upstream's: advertise this NIC's address instead (needs netifaces)
  MEM_FRACTION            GPU memory fraction for weights and KV pools, in (0, 1] (default: upstream's)
  NCCL_PORT               port of the tensor-parallel group's rendezvous (default: a free port);
                          set distinct ones when prefill and decode share a host
  SERVED_MODEL_NAME       model name the OpenAI API reports (default: MODEL_PATH)
  ENABLE_HICACHE          1: hierarchical (host-memory) KV cache on (default 0)
  HICACHE_RATIO           host pool size / device pool size
  HICACHE_SIZE            host pool size in GB (overrides HICACHE_RATIO)
  HICACHE_WRITE_POLICY    write_back | write_through | write_through_selective
  HICACHE_IO_BACKEND      direct | kernel
  HICACHE_MEM_LAYOUT      layer_first | page_first | page_first_direct | ...
  SGLANG_DSV4_INDEX_K_DTYPE
                          index-K storage: bf16 (default here) | fp8 | fp4; prefill and decode
                          must use the same
  SGLANG_DSV4_SKIP_FIXES  comma-separated fix ids to leave out (`status` lists the ids)

Checked before anything starts (one line, exit 2): every variable above; SGLANG_DSV4_* as the
plugin reads them; HICACHE_WRITE_POLICY, HICACHE_IO_BACKEND, HICACHE_MEM_LAYOUT against
upstream's own choices (read from its ServerArgs parser).

router
  PREFILL_URLS            required: comma-separated prefill URLs, e.g. http://10.0.0.1:30000;
                          URL@PORT gives that server's bootstrap port, else DISAGG_BOOTSTRAP_PORT
  DECODE_URLS             required: comma-separated decode URLs, e.g. http://10.0.0.2:30001
  HOST, PORT              address and port of the router (default 0.0.0.0, 8000)
  DISAGG_BOOTSTRAP_PORT   prefill bootstrap port where PREFILL_URLS gives none (default 8998)

all serving roles
  EXTRA_ARGS              more flags for the command, split on whitespace
  PYTHON                  interpreter (default python3)
  SGLANG_DSV4_HEALTH_FILE where the role records its /health URL for the `health` role
                          (the image sets it; unset on bare metal)
EOF
}

readonly ROLES="prefill, decode, router, status, plan, health"
PYTHON=${PYTHON:-python3}
role=""
dry_run=0
cmd=()

# One line naming the problem, exit 2: what an operator reads in `docker logs`.
die() {
	printf 'sglang-dsv4%s: %s\n' "${role:+ $role}" "$1" >&2
	exit 2
}

require() { # NAME WHAT
	[[ -n ${!1:-} ]] || die "$1 is not set: $2"
}

check_port() { # NAME VALUE
	if [[ ! $2 =~ ^[1-9][0-9]{0,4}$ ]] || (($2 > 65535)); then
		die "$1 must be a port number (1-65535), got '$2'"
	fi
}

check_positive_int() { # NAME VALUE
	[[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

check_positive_number() { # NAME VALUE
	[[ $2 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ && $2 =~ [1-9] ]] ||
		die "$1 must be a positive number, got '$2'"
}

check_fraction() { # NAME VALUE
	[[ $2 =~ ^(0?\.[0-9]+|1|1\.0*)$ && $2 =~ [1-9] ]] ||
		die "$1 must be a number in (0, 1], got '$2'"
}

is_on() { # NAME: true for 1/true/yes/on, false for unset/0/false/no/off
	local value=${!1:-}
	case ${value,,} in
	1 | true | yes | on) return 0 ;;
	"" | 0 | false | no | off) return 1 ;;
	*) die "$1 must be 1 or 0, got '$value'" ;;
	esac
}

# `--flag VALUE` for each set, non-empty variable.
optional_flag() { # NAME FLAG
	if [[ -n ${!1:-} ]]; then
		cmd+=("$2" "${!1}")
	fi
}

append_extra_args() {
	local -a extra=()
	# Whitespace-split without globbing; values with spaces go after the role instead.
	read -r -a extra <<<"${EXTRA_ARGS:-}"
	cmd+=("${extra[@]}")
}

hicache_flags() {
	local name
	if is_on ENABLE_HICACHE; then
		cmd+=(--enable-hierarchical-cache)
		if [[ -n ${HICACHE_RATIO:-} ]]; then check_positive_number HICACHE_RATIO "$HICACHE_RATIO"; fi
		if [[ -n ${HICACHE_SIZE:-} ]]; then check_positive_int HICACHE_SIZE "$HICACHE_SIZE"; fi
		optional_flag HICACHE_RATIO --hicache-ratio
		optional_flag HICACHE_SIZE --hicache-size
		optional_flag HICACHE_WRITE_POLICY --hicache-write-policy
		optional_flag HICACHE_IO_BACKEND --hicache-io-backend
		optional_flag HICACHE_MEM_LAYOUT --hicache-mem-layout
		return
	fi
	# A HiCache setting with HiCache off is a mistake, not something to drop quietly.
	for name in HICACHE_RATIO HICACHE_SIZE HICACHE_WRITE_POLICY HICACHE_IO_BACKEND HICACHE_MEM_LAYOUT; do
		[[ -z ${!name:-} ]] || die "$name is set but HiCache is off (set ENABLE_HICACHE=1)"
	done
}

# The address a local health probe reaches the server on.
probe_host() {
	case ${1:-} in
	"" | 0.0.0.0 | "::" | "[::]") printf '127.0.0.1' ;;
	*:*) printf '[%s]' "${1//[][]/}" ;; # an IPv6 literal, bracketed once
	*) printf '%s' "$1" ;;
	esac
}

# The distribution's variables (index-K dtype, fix ids to skip) as its plugin reads them, and
# each NAME=--flag given whose variable is set against upstream's own choices for --flag (that
# imports upstream's ServerArgs, seconds). One line and exit 2 instead of a server that refuses
# minutes later.
check_settings() { # [NAME=--flag ...]
	local message
	if ! message=$(SGLANG_DSV4_INDEX_K_DTYPE=${SGLANG_DSV4_INDEX_K_DTYPE:-bf16} \
		"$PYTHON" -m sglang_dsv4.envcheck "$@" 2>&1); then
		die "${message##*$'\n'}"
	fi
}

server_command() { # MODE DEFAULT_PORT
	local mode=$1 tp=${TP:-4} host=${HOST:-0.0.0.0} port=${PORT:-$2}
	require MODEL_PATH "the model folder (or Hugging Face id) to serve"
	check_positive_int TP "$tp"
	check_port PORT "$port"
	if [[ -n ${MEM_FRACTION:-} ]]; then check_fraction MEM_FRACTION "$MEM_FRACTION"; fi
	if [[ -n ${NCCL_PORT:-} ]]; then check_port NCCL_PORT "$NCCL_PORT"; fi
	# bf16 index keys are this distribution's choice for DeepSeek-V4 (the plugin's own default
	# is upstream's fp8); passing the value explicitly shows it in the printed command.
	cmd=(env "SGLANG_DSV4_INDEX_K_DTYPE=${SGLANG_DSV4_INDEX_K_DTYPE:-bf16}"
		"$PYTHON" -m sglang.launch_server
		--model-path "$MODEL_PATH" --tp-size "$tp" --host "$host" --port "$port"
		--disaggregation-mode "$mode" --disaggregation-transfer-backend nixl)
	if [[ $mode == prefill ]]; then
		local bootstrap=${DISAGG_BOOTSTRAP_PORT:-8998}
		check_port DISAGG_BOOTSTRAP_PORT "$bootstrap"
		cmd+=(--disaggregation-bootstrap-port "$bootstrap")
	fi
	if [[ ${IB_DEVICE:-} == *:* ]]; then
		die "IB_DEVICE takes HCA names without a port (mlx5_0, not mlx5_0:1): NIXL adds port 1; got '$IB_DEVICE'"
	fi
	if [[ -n ${IB_DEVICE:-} && -n ${UCX_NET_DEVICES:-} ]]; then
		die "IB_DEVICE and UCX_NET_DEVICES are both set; upstream would ignore IB_DEVICE: set one"
	fi
	optional_flag IB_DEVICE --disaggregation-ib-device
	optional_flag MEM_FRACTION --mem-fraction-static
	optional_flag NCCL_PORT --nccl-port
	optional_flag SERVED_MODEL_NAME --served-model-name
	hicache_flags
	append_extra_args
	check_settings HICACHE_WRITE_POLICY=--hicache-write-policy \
		HICACHE_IO_BACKEND=--hicache-io-backend HICACHE_MEM_LAYOUT=--hicache-mem-layout
	health_url="http://$(probe_host "$host"):$port/health"
}

# URL list -> array `urls`; an empty list is the same mistake as an unset variable.
split_urls() { # NAME
	local entry
	local -a entries=()
	urls=()
	IFS=, read -r -a entries <<<"${!1}"
	for entry in "${entries[@]}"; do
		entry=${entry//[[:space:]]/}
		[[ -z $entry ]] || urls+=("$entry")
	done
	((${#urls[@]})) || die "$1 holds no URL"
}

check_url() { # NAME URL
	[[ $2 =~ ^https?://[^/[:space:]]+(/.*)?$ ]] || die "$1: '$2' is not an http(s):// URL"
}

router_command() {
	local host=${HOST:-0.0.0.0} port=${PORT:-8000} bootstrap=${DISAGG_BOOTSTRAP_PORT:-8998}
	local url entry entry_port
	require PREFILL_URLS "comma-separated prefill server URLs (URL@BOOTSTRAP_PORT for a bootstrap port other than DISAGG_BOOTSTRAP_PORT)"
	require DECODE_URLS "comma-separated decode server URLs"
	check_port PORT "$port"
	check_port DISAGG_BOOTSTRAP_PORT "$bootstrap"
	cmd=("$PYTHON" -m sglang_router.launch_router --pd-disaggregation --host "$host" --port "$port")
	split_urls PREFILL_URLS
	for entry in "${urls[@]}"; do
		url=$entry entry_port=$bootstrap
		if [[ $entry =~ ^(.+)@([0-9]+)$ ]]; then
			url=${BASH_REMATCH[1]} entry_port=${BASH_REMATCH[2]}
			check_port "PREFILL_URLS bootstrap port of $url" "$entry_port"
		fi
		check_url PREFILL_URLS "$url"
		cmd+=(--prefill "$url" "$entry_port")
	done
	split_urls DECODE_URLS
	for url in "${urls[@]}"; do
		check_url DECODE_URLS "$url"
		cmd+=(--decode "$url")
	done
	append_extra_args
	health_url="http://$(probe_host "$host"):$port/health"
}

dsv4_command() { # SUBCOMMAND
	check_settings
	cmd=(env "SGLANG_DSV4_INDEX_K_DTYPE=${SGLANG_DSV4_INDEX_K_DTYPE:-bf16}" "$PYTHON" -m sglang_dsv4 "$1")
}

health_check() {
	local file=${SGLANG_DSV4_HEALTH_FILE:-}
	if [[ -z $file || ! -r $file ]]; then
		echo "sglang-dsv4 health: no server role has started here" >&2
		exit 1
	fi
	# Docker reads 1 as unhealthy and reserves 2, so every failure is 1.
	curl -fsS --max-time 5 -o /dev/null "$(<"$file")" || exit 1
	exit 0
}

print_command() {
	local word quoted=()
	for word in "${cmd[@]}"; do
		quoted+=("$(printf '%q' "$word")")
	done
	printf '%s\n' "${quoted[*]}"
}

while (($#)); do
	case $1 in
	--dry-run) dry_run=1 ;;
	-h | --help)
		usage
		exit 0
		;;
	*) break ;;
	esac
	shift
done
(($#)) || die "no role given (roles: $ROLES; --help lists the variables)"
role=$1
shift
if [[ ${1:-} == --dry-run ]]; then
	dry_run=1
	shift
fi

health_url=""
case $role in
prefill) server_command prefill 30000 ;;
decode) server_command decode 30001 ;;
router) router_command ;;
status) dsv4_command status ;;
plan)
	dsv4_command plan
	optional_flag MODEL_PATH --model
	optional_flag TP --tp
	;;
health) health_check ;;
*)
	role_given=$role
	role=""
	die "unknown role '$role_given' (roles: $ROLES)"
	;;
esac
cmd+=("$@")

if ((dry_run)); then
	print_command
	exit 0
fi
if [[ -n $health_url ]]; then
	# The image's HEALTHCHECK probes whatever server this container runs (`health` role).
	if [[ -n ${SGLANG_DSV4_HEALTH_FILE:-} ]]; then
		printf '%s\n' "$health_url" >"$SGLANG_DSV4_HEALTH_FILE"
	fi
	printf 'sglang-dsv4 %s: %s\n' "$role" "$(print_command)" >&2
fi
exec "${cmd[@]}"
