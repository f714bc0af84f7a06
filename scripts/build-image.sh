#!/usr/bin/env bash
# Build docker/Dockerfile with whichever image builder this machine has (docker with a running
# engine, podman, or buildah), tagged with this release's version, then print the image's id and
# size. The base (CUDA_IMAGE) and the GPU architectures are the Dockerfile's unless given.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: scripts/build-image.sh [options]

  --tag NAME[:TAG]     image name (default: sglang-dsv4-sm120:VERSION, pyproject.toml's version)
  --base IMAGE         base image, the Dockerfile's CUDA_IMAGE (default: $CUDA_IMAGE if set,
                       else the Dockerfile's nvidia/cuda devel tag)
  --arch LIST          TORCH_CUDA_ARCH_LIST, e.g. 10.0 for B200 (default: the Dockerfile's, 12.0)
  --builder NAME       docker | podman | buildah (default: $IMAGE_BUILDER if set, else the first
                       of them that can build here)
  --build-arg K=V      another build argument (repeatable)
  --network MODE       network of the build's RUN steps (e.g. host)
  --ca-bundle FILE     CA bundle pip trusts while it installs (the build secret pip-ca): for a
                       network behind a TLS-inspecting proxy
  -h, --help           this text

The last line printed is "image ID SIZE TAG" (SIZE in bytes where the builder reports them).
EOF
}

die() {
	printf 'build-image: %s\n' "$1" >&2
	exit 2
}

repo=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version = "\([^"]*\)"$/\1/p' "$repo/pyproject.toml" | head -n 1)
[[ -n $version ]] || die "no version in $repo/pyproject.toml"
tag="sglang-dsv4-sm120:$version"
builder=${IMAGE_BUILDER:-}
network=""
args=()
[[ -z ${CUDA_IMAGE:-} ]] || args+=(--build-arg "CUDA_IMAGE=$CUDA_IMAGE")

while (($#)); do
	case $1 in
	--tag | --base | --arch | --builder | --build-arg | --network | --ca-bundle)
		(($# >= 2)) || die "$1 needs a value"
		case $1 in
		--tag) tag=$2 ;;
		--base) args+=(--build-arg "CUDA_IMAGE=$2") ;;
		--arch) args+=(--build-arg "TORCH_CUDA_ARCH_LIST=$2") ;;
		--builder) builder=$2 ;;
		--build-arg)
			[[ $2 == ?*=* ]] || die "--build-arg takes KEY=VALUE, got '$2'"
			args+=(--build-arg "$2")
			;;
		--network) network=$2 ;;
		--ca-bundle)
			[[ -r $2 ]] || die "--ca-bundle: cannot read '$2'"
			args+=(--secret "id=pip-ca,src=$2")
			;;
		esac
		shift 2
		;;
	-h | --help)
		usage
		exit 0
		;;
	*) die "unknown argument '$1' (--help lists the options)" ;;
	esac
done

# docker counts only with an engine to talk to: its client alone cannot build.
can_build() { # NAME
	case $1 in
	docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
	podman | buildah) command -v "$1" >/dev/null ;;
	*) die "unknown builder '$1' (docker, podman or buildah)" ;;
	esac
}
if [[ -z $builder ]]; then
	for candidate in docker podman buildah; do
		if can_build "$candidate"; then
			builder=$candidate
			break
		fi
	done
	[[ -n $builder ]] || die "no image builder here: install docker (with its engine), podman or buildah"
else
	can_build "$builder" || die "$builder cannot build here (not installed, or docker without a running engine)"
fi

build=()
case $builder in
docker) build=(docker build) ;;
# The docker image format: the OCI format has no HEALTHCHECK, which podman and buildah would drop.
podman) build=(podman build --format docker) ;;
buildah) build=(buildah build --format docker) ;;
esac
[[ -z $network ]] || build+=(--network "$network")
build+=(-f "$repo/docker/Dockerfile" -t "$tag" "${args[@]}" "$repo")

started=$SECONDS
printf 'build-image: %s\n' "${build[*]}" >&2
"${build[@]}"
printf 'build-image: built %s in %d s\n' "$tag" $((SECONDS - started)) >&2

case $builder in
docker | podman) "$builder" image inspect --format "image {{.Id}} {{.Size}} $tag" "$tag" ;;
buildah) buildah images --no-trunc --noheading --format "image {{.ID}} {{.Size}} $tag" "$tag" ;;
esac
