#!/usr/bin/env bash
# Debian packages the serving images need (`make demo` and `make test` run this first):
#   squashfs-tools  mksquashfs: the seekable image's filesystem
#   docker-registry the embedded OCI registry (CNCF distribution), started on 127.0.0.1 only
#   fuse3           fusermount3 and libfuse3: the lazy image's FUSE front ends
#   strace          records the files a runtime reads while it starts (placed first in the image)
#   skopeo, umoci   the tests read the OCI image layouts modelplane writes with them
#   apache2-utils   htpasswd: the tests run the registry with basic auth
#   prometheus      `modelplane up --prometheus` (with promtool, which the tests use), on 127.0.0.1 only
# As root with apt-get, installs what is missing; otherwise prints the command to run.
set -euo pipefail
declare -A package_of=(
  [mksquashfs]=squashfs-tools [docker-registry]=docker-registry [fusermount3]=fuse3
  [strace]=strace [skopeo]=skopeo [umoci]=umoci [htpasswd]=apache2-utils [prometheus]=prometheus
)
missing=()
for command in "${!package_of[@]}"; do
  command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ] || [ -x "/usr/bin/$command" ] \
    || missing+=("${package_of[$command]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # the docker-registry package starts its own daemon where systemd runs, listening on every
  # interface with the packaged config: modelplane never uses that one
  # (the prometheus package likewise starts one on every interface, port 9090)
  for unit in docker-registry prometheus; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$unit" 2>/dev/null; then
      systemctl disable --now "$unit" || true
    fi
  done
else
  echo "modelplane needs these Debian packages: ${missing[*]}" >&2
  echo "install them with:  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
