#!/usr/bin/env bash
# Sprout host set-up: idempotent, one line per item ("ok" already there, "done" just made, "skip" left
# alone on purpose). A failed step stops the script with a message saying what to do.
#
# Run as root, or as a user with sudo (rootless): then sudo is asked only for the apt packages, the store
# (a loop file mounted with user_subvol_rm_allowed, owned by the user, in /etc/fstab for reboots) and
# subordinate uids/gids, and each line that used it says "(sudo)". Podman's configuration, the venv, the
# runtime and the base images are the user's own.
#
#   ops/setup_podman.sh [--microvm] [--dev]
#     --microvm  also the microVM backend: QEMU, busybox, a compiler for the guest agent, and the guest
#                kernel, taken out of Debian's kernel package into the store (no boot kernel is installed
#                on the host); or SPROUT_MICROVM=1
#     --dev      also what only Sprout's own tests need: its test tools in the venv and Debian's
#                docker-registry (the tests start their own registries) and chromium (the viewer is
#                tested in it); .ci/run passes it
#
#   SPROUT_STORE       btrfs store directory      (default ~/sprout-btrfs)
#   SPROUT_STORE_SIZE  size of its sparse loop file when the path is not on btrfs (default 40G)
#   SPROUT_STORE_MIN_FREE_GB  the loop file grows when the store has less free than this (default 10)
#   SPROUT_PYTHON      the Python 3.12 to build .venv with (default: found via pyenv / PATH)
#   SPROUT_CGROUP_FAVORDYNMODS  0: leave the cgroup2 mount's options alone (default 1: favordynmods on)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATH="$PATH:/usr/sbin:/sbin"  # mkfs.btrfs, losetup, usermod: a user's PATH may lack them
STORE="${SPROUT_STORE:-$HOME/sprout-btrfs}"
STORE_IMG="${SPROUT_STORE_IMAGE:-$STORE.img}"
STORE_SIZE="${SPROUT_STORE_SIZE:-40G}"
STORE_MIN_FREE_GB="${SPROUT_STORE_MIN_FREE_GB:-10}"
VENV="$REPO/.venv"
MICROVM="${SPROUT_MICROVM:-0}"
DEV=0

say() { printf '%-5s %s\n' "$1" "$2"; }
ROOTLESS=0; SUDO_SAID=""
if [ "$(id -u)" != 0 ]; then ROOTLESS=1; SUDO_SAID=" (sudo)"; fi
as_root() {  # a command that needs root: sudo when rootless
  if [ "$ROOTLESS" = 1 ]; then sudo "$@"; else "$@"; fi
}
die() { printf 'FAIL  %s\n' "$1" >&2; exit 1; }
fstype() { stat -f -c %T "$1" 2>/dev/null || echo none; }
trap 'die "step failed at line $LINENO: $BASH_COMMAND"' ERR

for arg in "$@"; do
  case "$arg" in
    --microvm) MICROVM=1 ;;
    --dev) DEV=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown option $arg (ops/setup_podman.sh [--microvm] [--dev])" ;;
  esac
done
FAVORDYNMODS="${SPROUT_CGROUP_FAVORDYNMODS:-1}"
[[ "$FAVORDYNMODS" =~ ^[01]$ ]] || die "SPROUT_CGROUP_FAVORDYNMODS=$FAVORDYNMODS: use 0 to leave the cgroup2 mount alone, 1 (the default) for favordynmods"
[[ "$MICROVM" =~ ^[01]$ ]] || die "SPROUT_MICROVM=$MICROVM: use 1 (or --microvm) for the microVM backend, 0 for none"

EXTRAS="mini,harbor,runstore,proxy"  # proxy: the bundled LiteLLM proxy
[ "$DEV" = 1 ] && EXTRAS="$EXTRAS,dev"  # the tests, linters, type checker and docs builder
# gcc and libc6-dev compile the runtime (and the microVM guest's agent)
APT_PACKAGES=(podman btrfs-progs runc mmdebstrap uidmap containernetworking-plugins iptables catatonit
              ca-certificates rsync iproute2 gcc libc6-dev)
# the microVM backend: QEMU, busybox for the guest, ext4 and initramfs tools
MICROVM_PACKAGES=(qemu-system-x86 busybox-static e2fsprogs cpio)
[ "$MICROVM" = 1 ] && APT_PACKAGES+=("${MICROVM_PACKAGES[@]}")
[ "$DEV" = 1 ] && APT_PACKAGES+=(docker-registry chromium)  # chromium: the viewer's browser tests
[ "$ROOTLESS" = 1 ] && APT_PACKAGES+=(slirp4netns fuse-overlayfs)  # rootless podman's network and storage

[[ "$STORE_MIN_FREE_GB" =~ ^[0-9]+$ ]] || die "SPROUT_STORE_MIN_FREE_GB=$STORE_MIN_FREE_GB: give whole GiB, e.g. 10"
if [ "$ROOTLESS" = 1 ]; then
  command -v sudo >/dev/null 2>&1 || die "run as root, or as a user with sudo (for the packages, the store and subuids)"
fi

# ---------------------------------------------------------------- apt packages
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  say ok "apt packages: ${APT_PACKAGES[*]}"
else
  as_root apt-get update -qq || die "apt-get update failed (is a Debian mirror reachable?)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
  say done "apt packages: installed ${missing[*]}$SUDO_SAID"
fi

# ---------------------------------------------------------------- subordinate ids (rootless)
# Rootless podman maps a container's uids 1..65536 onto a range of the user's subordinate ids.
if [ "$ROOTLESS" = 1 ]; then
  me="$(id -un)"
  range() { awk -F: -v me="$me" -v id="$(id -u)" '$1 == me || $1 == id {print $2 ":" $3; exit}' "$1"; }
  if [ -n "$(range /etc/subuid)" ] && [ -n "$(range /etc/subgid)" ]; then
    say ok "subordinate ids: $me has uids $(range /etc/subuid), gids $(range /etc/subgid)"
  else
    first=$(awk -F: 'BEGIN {m = 100000} {if ($2 + $3 > m) m = $2 + $3} END {print m}' /etc/subuid /etc/subgid)
    as_root usermod --add-subuids "$first-$((first + 65535))" --add-subgids "$first-$((first + 65535))" "$me" \
      || die "usermod --add-subuids failed"
    podman system migrate >/dev/null 2>&1 || true  # podman's user namespace is made again with them
    say done "subordinate ids: gave $me uids and gids $first:65536$SUDO_SAID"
  fi
else
  say skip "subordinate ids: running as root (rootless podman needs them, the set-up run as a user adds them)"
fi

# ---------------------------------------------------------------- podman configuration
# crun fails on these cgroup-v1 hosts and podman's default rlimits exceed the hard limits. Sprout passes
# --runtime runc --cgroup-manager cgroupfs and --ulimit itself; this drop-in makes a plain `podman`
# work too, unless the user already chose a runtime (then we leave their config alone).
# Rootless, the same settings are the user's own containers.conf.
DROPIN=/etc/containers/containers.conf.d/50-sprout.conf
[ "$ROOTLESS" = 1 ] && DROPIN="${XDG_CONFIG_HOME:-$HOME/.config}/containers/containers.conf"
HEADER="# written by Sprout ops/setup_podman.sh"
nofile_hard=$(ulimit -Hn); nproc_hard=$(ulimit -Hu)
[ "$nofile_hard" = unlimited ] && nofile_hard=1048576
[ "$nproc_hard" = unlimited ] && nproc_hard=32768
nofile=$(( nofile_hard < 1048576 ? nofile_hard : 1048576 ))
nproc=$(( nproc_hard < 32768 ? nproc_hard : 32768 ))
want=$(printf '%s\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n' \
  "$HEADER" "$nofile" "$nofile" "$nproc" "$nproc")
# another file choosing a runtime or cgroup manager (not one this script wrote) is the user's choice
user_conf=$(grep -lsE '^\s*(runtime|cgroup_manager)\s*=' /etc/containers/containers.conf \
  /etc/containers/containers.conf.d/*.conf "$HOME/.config/containers/containers.conf" 2>/dev/null \
  | while read -r f; do [ "$(head -1 "$f")" = "$HEADER" ] || echo "$f"; done || true)
if [ -n "$user_conf" ]; then
  say skip "podman config: keeping your settings in $user_conf (Sprout passes its own flags)"
elif [ -f "$DROPIN" ] && [ "$(cat "$DROPIN")" = "$want" ]; then
  say ok "podman config: $DROPIN (runc, cgroupfs, ulimits nofile=$nofile nproc=$nproc)"
else
  mkdir -p "$(dirname "$DROPIN")"
  printf '%s\n' "$want" > "$DROPIN.tmp" && mv "$DROPIN.tmp" "$DROPIN"
  say done "podman config: wrote $DROPIN (runc, cgroupfs, ulimits nofile=$nofile nproc=$nproc)"
fi
podman info --format '{{.Host.OCIRuntime.Name}}' >/dev/null 2>&1 \
  || die "podman does not run: $(podman info 2>&1 | tail -1)"
say ok "podman runs: $(podman --version), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')"

# ---------------------------------------------------------------- cgroup favordynmods
# A command through sprout-runtime, and runc as a container starts, joins the sandbox's cgroups by writing
# their cgroup.procs. By default the kernel makes such a write wait for an RCU grace period when none came
# just before: an agent's every command, issued after its model call, waited ~10 ms for it here. The cgroup2
# mount's favordynmods option (Linux 6.0+) removes the wait, for the whole host, at what the kernel
# documents as a slightly dearer fork and exit (not measurable here). It lasts until the next boot.
# SPROUT_CGROUP_FAVORDYNMODS=0 leaves the mount alone.
cgroup2=""
for point in /sys/fs/cgroup /sys/fs/cgroup/unified; do
  if [ "$(fstype "$point")" = cgroup2fs ]; then cgroup2=$point; break; fi
done
has_favordynmods() {
  awk -v m="$cgroup2" '$2 == m && $3 == "cgroup2" && ("," $4 ",") ~ /,favordynmods,/ {found = 1} END {exit !found}' /proc/mounts
}
if [ "$ROOTLESS" = 1 ]; then
  say skip "cgroup favordynmods: rootless sandboxes join no cgroups of their own"
elif [ "$FAVORDYNMODS" = 0 ]; then
  say skip "cgroup favordynmods: left alone (SPROUT_CGROUP_FAVORDYNMODS=0)"
elif [ -z "$cgroup2" ]; then
  say skip "cgroup favordynmods: no cgroup2 mount (cgroup v1 only)"
elif has_favordynmods; then
  say ok "cgroup favordynmods: on ($cgroup2)"
elif why=$(mount -o remount,favordynmods "$cgroup2" 2>&1) && has_favordynmods; then
  say done "cgroup favordynmods: on ($cgroup2) until the next boot; commands join their sandbox's cgroups without waiting"
else
  why=${why%%$'\n'*}; why=${why%.}
  say skip "cgroup favordynmods: cannot remount $cgroup2 with it (${why:-the option did not stay}; Linux 6.0+ has it), so each command waits ~10 ms to join its cgroups"
fi

# ---------------------------------------------------------------- local registry (tests, --dev)
# The tests pull images from Debian's docker-registry (distribution v2), which tests/registry.py starts
# per test session on 127.0.0.1:<free port> with its own config. The package's own service (:5000,
# /var/lib/docker-registry) is not needed, so it is stopped and disabled; where systemd is not PID 1,
# systemctl only edits the unit links and the SysV script is used to stop it.
if [ "$DEV" = 1 ] && [ "$ROOTLESS" = 1 ]; then
  say skip "docker-registry service: left as it is (rootless; tests start their own on a free port)"
elif [ "$DEV" = 1 ]; then
  reg_changed=()
  if [ -d /run/systemd/system ]; then
    if systemctl is-active --quiet docker-registry 2>/dev/null; then
      systemctl stop docker-registry || die "systemctl stop docker-registry failed"
      reg_changed+=(stopped)
    fi
  else
    # The SysV script's pid file; `status` there counts a zombie as running, so look at /proc ourselves.
    reg_pid=$(cat /var/run/docker-registry.pid 2>/dev/null || true)
    reg_alive() { [ -n "$reg_pid" ] && [ -r "/proc/$reg_pid/stat" ] && [ "$(awk '{print $3}' "/proc/$reg_pid/stat" 2>/dev/null)" != Z ] \
                  && grep -qa docker-registry "/proc/$reg_pid/cmdline" 2>/dev/null; }
    if reg_alive; then
      kill "$reg_pid" 2>/dev/null || true
      for _ in $(seq 50); do reg_alive || break; sleep 0.2; done
      reg_alive && { kill -9 "$reg_pid" 2>/dev/null || true; sleep 0.5; }
      reg_alive && die "cannot stop docker-registry (pid $reg_pid from /var/run/docker-registry.pid)"
      rm -f /var/run/docker-registry.pid
      reg_changed+=(stopped)
    fi
  fi
  if [ "$(systemctl is-enabled docker-registry 2>/dev/null || true)" = enabled ]; then
    systemctl disable docker-registry >/dev/null 2>&1 || die "systemctl disable docker-registry failed"
    reg_changed+=(disabled)
  fi
  if [ ${#reg_changed[@]} -eq 0 ]; then
    say ok "docker-registry service: not running, not enabled (tests start their own)"
  else
    say done "docker-registry service: ${reg_changed[*]} (tests start their own on a free port)"
  fi
else
  say skip "test tools (docker-registry, pytest, linters): not asked for (--dev)"
fi

# ---------------------------------------------------------------- btrfs store
MOUNT_OPTIONS="loop,noatime"
[ "$ROOTLESS" = 1 ] && MOUNT_OPTIONS="$MOUNT_OPTIONS,user_subvol_rm_allowed"
mkdir -p "$STORE"
if [ "$(fstype "$STORE")" = btrfs ]; then
  say ok "btrfs store: $STORE ($(df -h --output=avail "$STORE" | tail -1 | tr -d ' ') free)"
else
  if [ ! -f "$STORE_IMG" ]; then
    truncate -s "$STORE_SIZE" "$STORE_IMG"
    mkfs.btrfs -q "$STORE_IMG" >/dev/null || die "mkfs.btrfs $STORE_IMG failed"
    say done "btrfs loop file: $STORE_IMG ($STORE_SIZE sparse)"
  else
    say ok "btrfs loop file: $STORE_IMG"
  fi
  as_root mount -o "$MOUNT_OPTIONS" "$STORE_IMG" "$STORE" || die "cannot mount $STORE_IMG at $STORE (loop devices?)"
  say done "btrfs store: mounted $STORE_IMG at $STORE$SUDO_SAID"
  STORE_MOUNTED=1
fi
if [ "$ROOTLESS" = 1 ]; then
  # The user deletes subvolumes it owns only on a filesystem mounted with user_subvol_rm_allowed.
  if ! findmnt -n -o OPTIONS --target "$STORE" | grep -q user_subvol_rm_allowed; then
    [ "$(findmnt -n -o SOURCE --target "$STORE")" = "$(losetup -n -O NAME -j "$STORE_IMG" 2>/dev/null | head -1)" ] \
      || die "$STORE is on a btrfs filesystem mounted without user_subvol_rm_allowed (ask for it, or set SPROUT_STORE to a directory off btrfs: a loop file is made)"
    as_root mount -o remount,user_subvol_rm_allowed "$STORE" || die "cannot remount $STORE with user_subvol_rm_allowed"
    say done "btrfs store: remounted with user_subvol_rm_allowed$SUDO_SAID"
    STORE_MOUNTED=1
  fi
  if [ "$(stat -c %u "$STORE")" != "$(id -u)" ]; then
    as_root chown "$(id -u):$(id -g)" "$STORE" || die "cannot give $STORE to $(id -un)"
    say done "btrfs store: $STORE owned by $(id -un)$SUDO_SAID"
  fi
  # Other users on the host must not read the agents' files: neither through the store nor its loop file.
  private=()
  for path in "$STORE" "$STORE_IMG"; do
    [ -e "$path" ] || continue
    mode=700; [ -f "$path" ] && mode=600
    if [ "$(stat -c %a "$path")" != "$mode" ]; then
      chmod "$mode" "$path" || die "cannot make $path private ($mode)"
      private+=("$path")
    fi
  done
  if [ ${#private[@]} -eq 0 ]; then
    say ok "btrfs store: private to $(id -un)"
  else
    say done "btrfs store: ${private[*]} private to $(id -un) (other users cannot read its sandboxes)"
  fi
  if [ -f "$STORE_IMG" ]; then
    if awk -v store="$STORE" '$2 == store {found = 1} END {exit !found}' /etc/fstab; then
      say ok "btrfs store: in /etc/fstab (mounted again after a reboot)"
    else
      printf '%s %s btrfs %s 0 0\n' "$STORE_IMG" "$STORE" "$MOUNT_OPTIONS" | as_root tee -a /etc/fstab >/dev/null \
        || die "cannot add $STORE to /etc/fstab"
      say done "btrfs store: added to /etc/fstab, so it is mounted again after a reboot$SUDO_SAID"
    fi
  fi
  # podman's user namespace keeps the mounts it was made with: made again, it sees the store's
  [ "${STORE_MOUNTED:-0}" = 0 ] || podman system migrate >/dev/null 2>&1 || true
fi
# A store on a loop file grows (sparse) when it runs low, as far as the disk under the file allows.
kib_free() { df --output=avail -k "$1" | tail -1 | tr -d ' '; }
gib() { echo "$(( $1 / 1048576 ))G"; }
want_kib=$(( STORE_MIN_FREE_GB * 1048576 )); store_kib="$(kib_free "$STORE")"
if [ "$store_kib" -ge "$want_kib" ]; then
  say ok "btrfs store space: $(gib "$store_kib") free (>= ${STORE_MIN_FREE_GB}G)"
else
  loop_dev="$(findmnt -n -o SOURCE --target "$STORE")"
  backing="$(losetup -n -O BACK-FILE "$loop_dev" 2>/dev/null | sed 's/ *$//' || true)"
  low="only $(gib "$store_kib") free in $STORE"
  gc_hint="sprout sandbox gc --older-than 86400 removes unused checkpoints and images older than a day"
  if [ -z "$backing" ] || [ ! -f "$backing" ]; then
    say skip "btrfs store space: $low and it is not a loop file to grow ($gc_hint)"
  else
    grow_kib=$(( want_kib - store_kib ))
    unallocated_kib=$(( ($(stat -c %s "$backing") - $(stat -c '%b * %B' "$backing")) / 1024 ))
    host_kib="$(kib_free "$(dirname "$backing")")"
    if [ "$host_kib" -lt $(( unallocated_kib + grow_kib )) ]; then
      say skip "btrfs store space: $low; the disk under $backing has no room to grow it ($gc_hint)"
    else
      truncate -s "+${grow_kib}K" "$backing"
      as_root losetup -c "$loop_dev"
      as_root btrfs filesystem resize max "$STORE" >/dev/null
      size="$(du -h --apparent-size "$backing" | cut -f1)"
      say done "btrfs store space: grew $backing to $size ($(gib "$(kib_free "$STORE")") free)$SUDO_SAID"
    fi
  fi
fi
if [ -d "/sys/fs/btrfs/$(findmnt -n -o UUID --target "$STORE")/qgroups" ]; then  # quotas are on
  as_root btrfs quota disable "$STORE"
  say done "btrfs quotas: disabled on $STORE (qgroups make snapshots slow)$SUDO_SAID"
else
  say ok "btrfs quotas: off"
fi

# ---------------------------------------------------------------- Python 3.12 venv
find_python() {
  if [ -n "${SPROUT_PYTHON:-}" ]; then echo "$SPROUT_PYTHON"; return; fi
  command -v pyenv >/dev/null 2>&1 && for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | sort -V -r); do
    p="$(pyenv root)/versions/$v/bin/python3.12"; [ -x "$p" ] && { echo "$p"; return; }
  done
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
}
PY=$(find_python)
[ -n "$PY" ] || die "no Python 3.12 found (install it with pyenv, or set SPROUT_PYTHON)"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  say ok "venv: $VENV ($("$VENV/bin/python" --version))"
else
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  say done "venv: $VENV from $PY"
fi
stamp="$VENV/.sprout-install"
want_stamp="$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1) $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && MSWEA_SILENT_STARTUP=1 "$VENV/bin/python" -c 'import sprout, minisweagent, harbor' >/dev/null 2>&1; then
  say ok "python package: sprout[$EXTRAS] installed"
else
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
  "$VENV/bin/python" -m pip install -q -e "$REPO[$EXTRAS]" >/dev/null 2>"$VENV/pip-errors.log" \
    || die "pip install -e .[$EXTRAS] failed: $(tail -3 "$VENV/pip-errors.log")"
  echo "$want_stamp" > "$stamp"
  say done "python package: installed sprout[$EXTRAS]"
fi
# An editable install leaves src/ uncompiled, and where PYTHONDONTWRITEBYTECODE is set no process writes
# its byte-code either: each one would compile every module it imports again (up to 0.3 s of CPU per process).
compiled=$("$VENV/bin/python" -m compileall -j 0 "$REPO/src" 2>&1 | grep -c '^Compiling' || true)
if [ "$compiled" -eq 0 ]; then
  say ok "byte-code: src/ compiled"
else
  say done "byte-code: compiled $compiled modules of src/"
fi

# ---------------------------------------------------------------- runtime
# sprout-runtime enters a running sandbox for each command (src/sprout/sandbox/runtime.c), compiled here.
RUNTIME="$REPO/runtime/sprout-runtime"
RUNTIME_SOURCE="$REPO/src/sprout/sandbox/runtime.c"
runtime_stamp="$(sha256sum "$RUNTIME_SOURCE" | cut -d' ' -f1)"
if [ -x "$RUNTIME" ] && [ "$(cat "$RUNTIME.source" 2>/dev/null)" = "$runtime_stamp" ]; then
  say ok "runtime: $RUNTIME"
else
  mkdir -p "$(dirname "$RUNTIME")"
  gcc -O2 -Wall -Wextra -Werror -o "$RUNTIME.tmp" "$RUNTIME_SOURCE" 2>"$RUNTIME.errors" \
    || die "compiling $RUNTIME_SOURCE failed: $(head -3 "$RUNTIME.errors")"
  rm -f "$RUNTIME.errors" && mv "$RUNTIME.tmp" "$RUNTIME" && echo "$runtime_stamp" > "$RUNTIME.source"
  say done "runtime: compiled $RUNTIME"
fi

# ---------------------------------------------------------------- base images
# Each name is pulled first; only a name no registry gives gets an offline Debian stand-in (said per line).
SPROUT_STORE="$STORE" "$VENV/bin/sprout" sandbox images bootstrap | sed 's/^/      /' \
  || die "base images failed (sprout sandbox images bootstrap)"
say ok "base images: python:3.11-slim, python:3.12-slim, debian:bookworm, ... in podman and the store (pulled, or stand-ins as listed)"

# ---------------------------------------------------------------- the microVM guest kernel (--microvm)
# Debian's kernel package is downloaded and only its kernel and the modules the guest loads are taken out,
# into the store: the host gets no boot kernel, initrd or boot entry.
if [ "$MICROVM" = 1 ]; then
  kernel_pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
  [ -n "$kernel_pkg" ] || die "cannot find the package linux-image-amd64 depends on (apt-get update?)"
  kernel_dir="$STORE/microvm/kernel/$kernel_pkg"
  if [ -n "$(ls "$kernel_dir"/boot/vmlinuz-* 2>/dev/null)" ]; then
    say ok "microVM guest kernel: $kernel_pkg in $kernel_dir"
  else
    download="$(mktemp -d)"
    (cd "$download" && apt-get download -qq "$kernel_pkg" >/dev/null 2>&1) || die "apt-get download $kernel_pkg failed"
    modules=$("$VENV/bin/python" -c 'from sprout.sandbox.microvm.guest import MODULES; print(" ".join(MODULES))')
    patterns=('./boot/vmlinuz-*')
    for module in $modules; do patterns+=("./lib/modules/*/$module.ko" "./lib/modules/*/$module.ko.xz"); done
    rm -rf "$kernel_dir.partial" && mkdir -p "$kernel_dir.partial"
    dpkg-deb --fsys-tarfile "$download"/*.deb | tar -x -C "$kernel_dir.partial" --wildcards "${patterns[@]}" \
      2>/dev/null || true  # a pattern with nothing to match (.ko or .ko.xz) is no failure
    rm -rf "$download"
    [ -n "$(ls "$kernel_dir.partial"/boot/vmlinuz-* 2>/dev/null)" ] || die "no vmlinuz in $kernel_pkg"
    rm -rf "$kernel_dir" && mv "$kernel_dir.partial" "$kernel_dir"
    say done "microVM guest kernel: $kernel_pkg taken out to $kernel_dir (nothing installed on the host)"
  fi
else
  say skip "microVM backend: not asked for (--microvm or SPROUT_MICROVM=1 installs QEMU and the guest kernel)"
fi
echo "ready: source .venv/bin/activate && sprout doctor"
