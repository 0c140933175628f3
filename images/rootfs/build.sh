#!/usr/bin/env bash
# Builds a Debian bookworm root filesystem tree for a Clade image.
#   build.sh PACKAGES_FILE OUT_DIR
# Produces OUT_DIR/tree (the root filesystem, without clade-guestd: that is added
# when the ext4 image is assembled, so a new agent never re-runs debootstrap).
# Needs root (debootstrap, chroot). Uses no loop device.
# Env: CLADE_MIRROR (default http://deb.debian.org/debian),
#      CLADE_INJECT_HOST_CA (default 1): trust the host's locally added CAs
#      (/usr/local/share/ca-certificates/*.crt) inside the guest, so a guest
#      behind the same TLS-intercepting proxy as the host can reach registries.
#      CLADE_PACKAGE_CACHE: a directory whose apt/ keeps the downloaded .debs
#      between builds (debootstrap's and apt's), so a rebuild downloads only
#      what changed; none without it.
set -euo pipefail
packages_file=$1 out=$2
package_cache=${CLADE_PACKAGE_CACHE:-}
mirror=${CLADE_MIRROR:-http://deb.debian.org/debian}
security_mirror=${CLADE_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
inject_ca=${CLADE_INJECT_HOST_CA:-1}

[ "$(id -u)" = 0 ] || { echo "rootfs build needs root (debootstrap, chroot)" >&2; exit 1; }
tree="$out/tree"
rm -rf "$tree"
mkdir -p "$tree"

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

cache_args=()
if [ -n "$package_cache" ]; then
  mkdir -p "$package_cache/apt"
  cache_args=(--cache-dir="$(realpath "$package_cache/apt")")
fi
echo "==> debootstrap bookworm (minbase)"
debootstrap --variant=minbase "${cache_args[@]}" bookworm "$tree" "$mirror" >"$out/debootstrap.log" 2>&1 \
  || { tail -20 "$out/debootstrap.log" >&2; exit 1; }

cat > "$tree/etc/apt/sources.list" <<SRC
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security_mirror bookworm-security main
SRC
# Keep the image small: no docs, man pages or translations.
cat > "$tree/etc/dpkg/dpkg.cfg.d/01-clade-nodoc" <<'CFG'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
CFG
cat > "$tree/etc/apt/apt.conf.d/01-clade" <<'CFG'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
CFG

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
  # apt downloads into the cache, and finds there what an earlier build fetched.
  mount --bind "$package_cache/apt" "$tree/var/cache/apt/archives"
  cache_mounts+=("$tree/var/cache/apt/archives")
fi

if [ "$inject_ca" = 1 ] && ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
  echo "==> trusting the host's local CAs inside the guest"
  mkdir -p "$tree/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$tree/usr/local/share/ca-certificates/"
fi

mapfile -t pkgs < <(grep -vE '^\s*(#|$)' "$packages_file")
echo "==> apt-get install ${pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
chroot "$tree" apt-get update -q >"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }
chroot "$tree" apt-get -y -q dist-upgrade >>"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }
chroot "$tree" apt-get -y -q install "${pkgs[@]}" >>"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }
chroot "$tree" update-ca-certificates >/dev/null 2>&1 || true

echo "==> configuring the guest"
# The default unprivileged user commands run as unless they ask for root.
chroot "$tree" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
echo "sandbox" > "$tree/etc/hostname"
cat > "$tree/etc/hosts" <<'HOSTS'
127.0.0.1 localhost
127.0.1.1 sandbox
::1 localhost ip6-localhost ip6-loopback
HOSTS
: > "$tree/etc/machine-id"
# Networking (and with it resolv.conf) is configured by clade-guestd at boot.
: > "$tree/etc/resolv.conf"
# PandaStack runs commands in /workspace; keep it, writable by the default user too.
mkdir -p "$tree/workspace" && chmod 1777 "$tree/workspace"

# The cache is let go first: cleaning must not empty it.
release_caches
chroot "$tree" apt-get clean
rm -rf "$tree"/var/lib/apt/lists/* "$tree"/var/cache/apt/*.bin "$tree"/var/log/* "$tree"/tmp/*
cleanup
mounts=()
echo "==> root filesystem tree ready: $(du -sh "$tree" | cut -f1)"
