#!/usr/bin/env bash
# Build the CPU serving image from a local Debian base, installing what is missing; idempotent, and quick when
# nothing changed. Used by tests/test_container.py (tests/container_util.py) and by hand:
#
#   scripts/container_setup.sh [--target cpu] [--no-build]
#
# 1. podman, buildah, debootstrap, runc from Debian's packages when one is missing (apt-get; needs root).
# 2. containers.conf (build/container/containers.conf, passed as CONTAINERS_CONF): runc, cgroupfs, file events,
#    nofile/nproc ulimits — what podman needs to build and run on these machines.
# 3. The base image localhost/unroll-base:bookworm: `debootstrap --variant=minbase bookworm` + `podman import`, the
#    root file system cached as build/container/bookworm-minbase.tar.gz (made once; later runs import it).
# 4. `python -m unroll.app.container stage` (the graphs, exported first if missing, and both Triton repositories in
#    build/image/), then the image localhost/unroll:<target>-<digest of the build context>: reused when it exists,
#    else built with `podman build` (pip in the build trusts the host's CA bundle, given as the build secret
#    pipcert: these machines reach the package index through a TLS-inspecting proxy).
#
# Output: progress on stderr; on stdout one last line, `image: NAME` — or `unavailable: REASON` with exit status 75
# when this machine cannot build or run containers at all (no root to install podman, podman cannot run a
# container), which tests turn into a skip. Any other failure exits non-zero with the build log's tail.
# Environment: PYTHON (default .venv/bin/python), CA_BUNDLE (default $PIP_CERT or the system bundle),
# DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
target=cpu
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "usage: $0 [--target cpu] [--no-build]" >&2; exit 2 ;;
  esac
done

say() { echo "container_setup: $*" >&2; }
unavailable() { echo "unavailable: $*"; exit 75; }
started=$SECONDS

if [ "$target" != cpu ]; then
  unavailable "only --target cpu builds here: the gpu target starts FROM NVIDIA's Triton image (nvcr.io), which no \
registry reachable from this machine serves; hadolint checks it (tests/test_container.py)"
fi

# 1. tools -------------------------------------------------------------------------------------------------------
missing=()
for tool in podman buildah debootstrap runc; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    unavailable "${missing[*]} not installed, and installing them needs root (apt-get install ${missing[*]})"
  fi
  say "installing ${missing[*]} from Debian's packages"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >&2; then
    unavailable "apt-get could not install ${missing[*]}"
  fi
fi

# 2. containers.conf ---------------------------------------------------------------------------------------------
mkdir -p build/container
conf=$PWD/build/container/containers.conf
cat > "$conf.tmp" <<'EOF'
# Written by scripts/container_setup.sh (CONTAINERS_CONF): what podman needs on these machines.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
mv "$conf.tmp" "$conf"
export CONTAINERS_CONF=$conf

if ! podman info >/dev/null 2>build/container/podman-info.err; then
  unavailable "podman does not work here: $(head -n 1 build/container/podman-info.err)"
fi

# 3. base image ---------------------------------------------------------------------------------------------------
base=localhost/unroll-base:bookworm
tarball=build/container/bookworm-minbase.tar.gz
if ! podman image exists "$base"; then
  if [ ! -s "$tarball" ]; then
    [ "$(id -u)" = 0 ] || unavailable "debootstrap needs root to make the base image"
    say "debootstrap --variant=minbase bookworm (once; cached as $tarball)"
    rootfs=$(mktemp -d /var/tmp/unroll-rootfs.XXXXXX)
    if ! debootstrap --variant=minbase bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
        > build/container/debootstrap.log 2>&1; then
      rm -rf "$rootfs"
      tail -n 20 build/container/debootstrap.log >&2
      echo "container_setup: debootstrap failed (build/container/debootstrap.log)" >&2
      exit 1
    fi
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" --numeric-owner -czf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  say "podman import $tarball → $base"
  podman import --quiet "$tarball" "$base" >/dev/null
fi
if ! podman run --rm --network none "$base" true 2>build/container/podman-run.err; then
  unavailable "podman cannot run a container here: $(head -n 1 build/container/podman-run.err)"
fi

# 4. build context and image --------------------------------------------------------------------------------------
python=${PYTHON:-.venv/bin/python}
say "staging build/image/ (exporting graphs first when missing)"
"$python" -m unroll.app.container stage >&2
base_id=$(podman image inspect --format '{{.Id}}' "$base")
digest=$("$python" -m unroll.app.container digest --extra "target=$target base=$base_id")
image=localhost/unroll:$target-${digest:0:12}
if podman image exists "$image"; then
  say "$image is up to date (build context unchanged); $((SECONDS - started)) s"
  echo "image: $image"
  exit 0
fi
[ "$build" = 1 ] || { echo "image: $image (not built: --no-build)"; exit 0; }

ca=${CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
secret=()
[ -s "$ca" ] && secret=(--secret "id=pipcert,src=$ca")
log=build/container/build-$target.log
say "podman build --target $target → $image (log: $log)"
build_started=$SECONDS
if ! podman build --format docker --layers --target "$target" --build-arg "BASE_IMAGE=$base" "${secret[@]}" \
    --tag "$image" --tag "localhost/unroll:$target" . > "$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "container_setup: podman build failed ($log)" >&2
  exit 1
fi
say "built $image in $((SECONDS - build_started)) s; $(podman image inspect --format '{{.Size}}' "$image") bytes"
# Older builds of this target only take disk space (their cached layers stay for the next build).
podman images --format '{{.Repository}}:{{.Tag}}' | grep "^localhost/unroll:$target-" | grep -vx "$image" \
  | xargs -r podman rmi >/dev/null 2>&1 || true
echo "image: $image"
