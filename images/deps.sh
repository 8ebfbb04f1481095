#!/usr/bin/env bash
#
# images/deps.sh - install the Debian packages sandboxd and its image builds
# need on the host:
#   busybox-static  static /bin/busybox for the "minimal" image
#   btrfs-progs     btrfs subvolumes/snapshots for sandbox storage
#   debootstrap     builds the "debian" image
#   iproute2        ip(8), sandbox network setup (the egress filter's veth pairs)
#   nftables        nft(8): the egress filter's redirect/drop table
#   libsqlite3-dev  the SQLite the daemon's state store links against (the system's, not a copy
#                   compiled into every build)
#   util-linux      mount, unshare, nsenter, flock, ...
# and for the microVM tier (build-vm.sh, and QEMU itself):
#   qemu-system-x86 qemu-system-x86_64, the VMM of the microVM tier
#   qemu-utils      qemu-img: qcow2 base disks and per-sandbox overlays
#   linux-image-amd64  the guest kernel (the distribution's, with its modules)
#   e2fsprogs       mkfs.ext4 -d: the ext4 base disk from an image's rootfs
#   cpio            the initramfs
#   binutils        strip, readelf (agent and modules, the PVH kernel check)
#   file, xz-utils  checking and unpacking the kernel
# and for the escape suite (tests/probes: small static programs the tests build):
#   gcc, libc6-dev  gcc -static
# and for the Python SDK's tests (make pytest-sdk):
#   python3-venv    the virtualenv they run in
# and for the web page's test (tests/tests/web.rs):
#   chromium        a real headless browser, driven over its DevTools pipe
# Not installed here: kubectl for the Kubernetes manifests' check (deploy/kubernetes/check).
# It needs kustomize v5 (kubectl 1.27 or later); Debian 12's kubernetes-client is kubectl 1.20
# (kustomize v2.0.3), which cannot render the overlays, and would replace a newer kubectl.
#
# Each package is checked with `dpkg -s` first, so on a machine that already
# has everything this prints one line and changes nothing; `apt-get update`
# runs only when something must be installed. As root it installs what is
# missing; otherwise it prints the apt-get command to run and exits 1.
#
# Note: busybox-static conflicts with the dynamic `busybox` package, which apt
# will replace if it is installed.
set -euo pipefail

PACKAGES=(busybox-static btrfs-progs debootstrap iproute2 nftables libsqlite3-dev util-linux
    qemu-system-x86 qemu-utils linux-image-amd64 e2fsprogs cpio binutils file xz-utils
    gcc libc6-dev python3-venv dnsmasq-base chromium)
# How long to wait for another apt/dpkg run to release its locks.
LOCK_WAIT_SECONDS=${LOCK_WAIT_SECONDS:-600}

is_installed() {
    local status
    status="$(dpkg -s "$1" 2>/dev/null)" || return 1
    [[ $status == *$'\nStatus: install ok installed'* ]]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
    is_installed "$pkg" || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
    echo "deps: all present (${PACKAGES[*]})"
    exit 0
fi

install_cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing[*]}"
if ((EUID != 0)); then
    echo "deps: missing ${missing[*]}; install them as root with:" >&2
    echo "  $install_cmd" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "deps: installing ${missing[*]}"

# `apt-get update` does not honour DPkg::Lock::Timeout (it only applies to the
# dpkg locks), so retry while another apt holds the lists lock.
deadline=$((SECONDS + LOCK_WAIT_SECONDS))
errlog="$(mktemp)"
trap 'rm -f -- "$errlog"' EXIT
until apt-get -q update 2>"$errlog"; do
    cat "$errlog" >&2
    if grep -q 'Could not get lock' "$errlog" && ((SECONDS < deadline)); then
        echo "deps: apt is busy, waiting for its lock..." >&2
        sleep 5
        continue
    fi
    echo "deps: apt-get update failed" >&2
    exit 1
done
cat "$errlog" >&2

apt-get -q -y -o DPkg::Lock::Timeout="$LOCK_WAIT_SECONDS" install "${missing[@]}"

# Installing can remove a package that was there: a machine with qemu-utils from
# bookworm-backports loses it when apt installs bookworm's qemu-system-x86 (the
# versions conflict), leaving no qemu-img. So every package is checked again,
# and what went missing is installed once more (now from one consistent suite).
removed=()
for pkg in "${PACKAGES[@]}"; do
    is_installed "$pkg" || removed+=("$pkg")
done
if ((${#removed[@]} > 0)); then
    echo "deps: installing again what the first install removed or missed: ${removed[*]}"
    apt-get -q -y -o DPkg::Lock::Timeout="$LOCK_WAIT_SECONDS" install "${removed[@]}"
fi

still_missing=()
for pkg in "${PACKAGES[@]}"; do
    is_installed "$pkg" || still_missing+=("$pkg")
done
if ((${#still_missing[@]} > 0)); then
    echo "deps: still missing after install: ${still_missing[*]}" >&2
    exit 1
fi
echo "deps: installed ${missing[*]}"
