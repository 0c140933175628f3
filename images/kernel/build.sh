#!/usr/bin/env bash
# Builds the Clade guest kernel (an uncompressed PVH vmlinux) from Debian's
# linux-source-6.1 and the config fragment next to this script.
#   build.sh FRAGMENT WORK_DIR OUT_DIR
# WORK_DIR keeps the unpacked source and the object tree between builds so a
# rebuild after a fragment change is incremental. OUT_DIR receives `vmlinux` and
# `config`; it is written only on success (the caller renames it into place).
set -euo pipefail
fragment=$1 work=$2 out=$3
jobs=$(nproc)

tarball=$(ls /usr/src/linux-source-6.1.tar.xz 2>/dev/null || true)
[ -n "$tarball" ] || { echo "linux-source-6.1 is not installed (apt-get install linux-source-6.1)" >&2; exit 1; }
version=$(dpkg-query -W -f='${Version}' linux-source-6.1)

mkdir -p "$work"
exec 9>"$work/.lock"
flock 9

src="$work/src-$version"
if [ ! -f "$src/.unpacked" ]; then
  echo "==> unpacking linux-source-6.1 $version"
  rm -rf "$src" && mkdir -p "$src"
  tar -xf "$tarball" -C "$src" --strip-components=1
  touch "$src/.unpacked"
fi

obj="$work/obj-$version"
mkdir -p "$obj"
echo "==> configuring (tinyconfig + $(basename "$fragment"))"
make -s -C "$src" O="$obj" tinyconfig >/dev/null
"$src/scripts/kconfig/merge_config.sh" -m -O "$obj" "$obj/.config" "$fragment" >/dev/null
make -s -C "$src" O="$obj" olddefconfig >/dev/null

# Every requested option must survive olddefconfig (a missing dependency drops it silently).
dropped=0
while IFS= read -r line; do
  case "$line" in CONFIG_*=*) ;; *) continue ;; esac
  if ! grep -qxF "$line" "$obj/.config"; then
    echo "kernel config: '$line' was requested but did not survive olddefconfig" >&2
    dropped=1
  fi
done < "$fragment"
[ "$dropped" = 0 ] || exit 1

echo "==> building vmlinux with $jobs jobs (about 6-10 min on 2 cores the first time)"
make -s -C "$src" O="$obj" -j"$jobs" vmlinux
mkdir -p "$out"
cp "$obj/vmlinux" "$out/vmlinux"
cp "$obj/.config" "$out/config"
echo "==> kernel ready: $out/vmlinux"
