#!/usr/bin/env bash
# Builds a Clade image's root filesystem tree on another image's finished
# tree (base's): a copy of it, more Debian packages, then an optional setup
# script run inside it (for what npm or PyPI provide).
#   extend.sh PARENT_TREE PACKAGES_FILE OUT_DIR [SETUP_SCRIPT]
# Produces OUT_DIR/tree, without clade-guestd (added when the ext4 image is
# assembled), as build.sh does. Needs root (chroot). Uses no loop device.
# The tree keeps the parent's apt sources, user and configuration.
# Env: CLADE_PACKAGE_CACHE: a directory keeping downloads between builds
# (apt/ for .debs, npm/ and pip/ for the setup's), as build.sh does.
set -euo pipefail
parent=$1 packages_file=$2 out=$3 setup=${4:-}
package_cache=${CLADE_PACKAGE_CACHE:-}

[ "$(id -u)" = 0 ] || { echo "rootfs build needs root (chroot)" >&2; exit 1; }
[ -d "$parent/etc" ] || { echo "no parent tree at $parent" >&2; exit 1; }
tree="$out/tree"
rm -rf "$tree"
mkdir -p "$out"

mounts=() cache_mounts=()
release_caches() {
  for m in "${cache_mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  cache_mounts=()
}
cleanup() {
  release_caches
  for ((i=${#mounts[@]}-1; i>=0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

echo "==> starting from $parent"
cp -a "$parent" "$tree"
for m in proc sys dev dev/pts; do
  case $m in
    proc) mount -t proc proc "$tree/proc" ;;
    sys) mount -t sysfs sys "$tree/sys" ;;
    *) mount --bind "/$m" "$tree/$m" ;;
  esac
  mounts+=("$tree/$m")
done
cp /etc/resolv.conf "$tree/etc/resolv.conf"
if [ -n "$package_cache" ]; then
  for pair in apt:var/cache/apt/archives npm:root/.npm pip:root/.cache/pip; do
    mkdir -p "$package_cache/${pair%%:*}" "$tree/${pair#*:}"
    mount --bind "$package_cache/${pair%%:*}" "$tree/${pair#*:}"
    cache_mounts+=("$tree/${pair#*:}")
  done
fi

mapfile -t pkgs < <(grep -vE '^\s*(#|$)' "$packages_file")
echo "==> apt-get install ${pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
chroot "$tree" apt-get update -q >"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }
chroot "$tree" apt-get -y -q install "${pkgs[@]}" >>"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }

if [ -n "$setup" ]; then
  echo "==> running the setup script inside the tree"
  cp "$setup" "$tree/tmp/clade-setup.sh"
  chroot "$tree" env HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    bash /tmp/clade-setup.sh >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log" >&2; exit 1; }
  tail -5 "$out/setup.log"
fi

# The caches are let go first: cleaning must not empty them.
release_caches
chroot "$tree" apt-get clean
rm -rf "$tree"/var/lib/apt/lists/* "$tree"/var/cache/apt/*.bin "$tree"/var/log/* "$tree"/tmp/* \
  "$tree"/root/.npm "$tree"/root/.cache
# Networking (and with it resolv.conf) is configured by clade-guestd at boot.
: > "$tree/etc/resolv.conf"
cleanup
mounts=()
echo "==> root filesystem tree ready: $(du -sh "$tree" | cut -f1)"
