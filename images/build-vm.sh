#!/usr/bin/env bash
#
# images/build-vm.sh IMAGES_DIR NAME - build the microVM boot files of an image.
#
# Produces IMAGES_DIR/NAME/vm/ from IMAGES_DIR/NAME/rootfs (made by
# build-NAME.sh; IMAGES_DIR is images/build by default in the Makefile):
#
#   vmlinuz         copy of the host's newest installed kernel, /boot/vmlinuz-<ver>
#   initramfs.img   uncompressed newc cpio: /init (the static sandbox-agent),
#                   /modules/*.ko and /modules.order (the load order)
#   rootfs.qcow2    ext4 holding rootfs/, sized to its content plus headroom;
#                   a read-only base (0444) that sandboxes get overlays on, and
#                   that the agent grows online to the overlay's virtual size
#   inputs.sha256   fingerprint of everything above was made from
#   vm.json         {"kernel", "kernel_version", "initramfs", "disk",
#                   "disk_bytes", "agent_sha256"}, written last: a vm/ without
#                   it is unfinished
#
# The agent is built here (static, `+crt-static`) with cargo into
# target/guest/ of the repository (AGENT_TARGET_DIR overrides). The kernel is
# the distribution's own, modular: the modules it needs to reach the disk and
# the host (virtio-mmio, virtio-blk, virtio-console, virtio-net, ext4 and their
# dependencies from modules.dep) go into the initramfs.
#
# Reproducible: the same rootfs, kernel and agent give the same bytes (sorted
# cpio entries with fixed mtimes, fixed ext4 UUID and hash seed, filesystem
# and inode times other than mtime set to SOURCE_DATE_EPOCH). Rebuilds are skipped when the inputs did not change
# (FORCE=1 rebuilds anyway).
#
# Environment overrides:
#   KERNEL_VERSION=VER     a kernel other than the newest in /boot
#   SOURCE_DATE_EPOCH=N    timestamps (default: the mtime of NAME/image.json)
#   INITRAMFS_COMPRESS=gzip  compress the initramfs (default: none, which boots
#                          faster: see images/README.md)
#   CARGO=cargo, AGENT_TARGET_DIR=DIR
#
# Needs root to read /boot/vmlinuz-* (0600 on Debian) and the image's
# root-only files, and e2fsprogs (1.43+ for mkfs.ext4 -d), cpio and
# qemu-utils (images/deps.sh installs them).
set -euo pipefail
umask 022

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(($# == 2)) || { echo "usage: $0 IMAGES_DIR NAME" >&2; exit 2; }
NAME=$2
IMAGE_NAME="$NAME/vm"
[[ -d $1 ]] || die "no images dir $1"
OUT_DIR="$(cd -- "$1" && pwd -P)"
IMAGE="$OUT_DIR/$NAME"
REPO="$(cd -- "$IMAGES_DIR/.." && pwd -P)"
[[ -f $IMAGE/image.json && -d $IMAGE/rootfs ]] \
    || die "$IMAGE is not a finished image (no image.json); build it first (images/build-$NAME.sh)"
[[ $(uname -m) == x86_64 ]] || die "microVM images are x86_64 only (this is $(uname -m))"
for tool in mkfs.ext4 debugfs cpio qemu-img sha256sum file strip readelf xz; do
    command -v "$tool" >/dev/null || die "$tool not found; run images/deps.sh as root"
done

SECONDS=0
# The image's own build lock: its rootfs must not be replaced while we read it.
exec {lockfd}>"$OUT_DIR/.$NAME.lock"
flock -n "$lockfd" || die "another build of '$NAME' holds $OUT_DIR/.$NAME.lock"

SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(stat -c %Y "$IMAGE/image.json")}
export SOURCE_DATE_EPOCH
COMPRESS=${INITRAMFS_COMPRESS:-none}
[[ $COMPRESS == none || $COMPRESS == gzip ]] || die "INITRAMFS_COMPRESS must be none or gzip"

# --- 1. Kernel -------------------------------------------------------------
if [[ -n ${KERNEL_VERSION:-} ]]; then
    KVER=$KERNEL_VERSION
else
    KVER="$(find /boot -maxdepth 1 -name 'vmlinuz-*' -printf '%f\n' | sed 's/^vmlinuz-//' | sort -V | tail -n 1)"
    [[ -n $KVER ]] || die "no kernel in /boot; install one (apt-get install linux-image-amd64)"
fi
KERNEL="/boot/vmlinuz-$KVER"
MODDIR="/lib/modules/$KVER"
[[ -r $KERNEL ]] || die "cannot read $KERNEL (it is root-only on Debian: run as root)"
[[ -f $MODDIR/modules.dep ]] || die "no $MODDIR/modules.dep for kernel $KVER"
log "kernel $KVER"

# Modules to load, each after its dependencies; NAME? where the kernel may not
# have it. ext4 looks up crc32c through the crypto API (a softdep modules.dep
# does not list): the generic one always loads, the SSE4.2 one where the CPU
# has it.
WANTED=(virtio_mmio virtio_console virtio_blk virtio_net crc32c_generic? crc32c-intel? ext4)

# module_path NAME -> its path relative to $MODDIR, per modules.dep ('-' = '_').
module_path() {
    awk -F: -v want="${1//-/_}" '{
        n = $1; sub(/.*\//, "", n); sub(/\.ko(\.(xz|zst|gz))?$/, "", n); gsub(/-/, "_", n)
        if (n == want) { print $1; exit }
    }' "$MODDIR/modules.dep"
}

# module_deps PATH -> its dependencies, in the order they must be loaded.
module_deps() {
    awk -F': *' -v m="$1" '$1 == m { n = split($2, d, " "); for (i = n; i >= 1; i--) print d[i]; exit }' \
        "$MODDIR/modules.dep"
}

ORDER=()
add_module() {
    local path=$1 have
    for have in "${ORDER[@]}"; do [[ $have == "$path" ]] && return 0; done
    ORDER+=("$path")
}
for want in "${WANTED[@]}"; do
    mod=${want%\?}
    path="$(module_path "$mod")"
    if [[ -z $path ]]; then
        if [[ $want == *\? ]] || grep -qE "/${mod//-/[-_]}\.ko\$" "$MODDIR/modules.builtin" 2>/dev/null; then
            continue # optional, or built into this kernel
        fi
        die "kernel $KVER has no module $mod (neither in modules.dep nor built in)"
    fi
    while IFS= read -r dep; do
        [[ -n $dep ]] && add_module "$dep"
    done < <(module_deps "$path")
    add_module "$path"
done

# extract_vmlinux BZIMAGE OUT: the ELF kernel inside a bzImage, if it has a PVH
# entry point (an XEN_ELFNOTE_PHYS32_ENTRY note, type 0x12).
extract_vmlinux() {
    local img=$1 out=$2 at
    # (Process substitution, not pipes: the decompressor stops reading at the end
    # of its stream, and pipefail would count the writer's SIGPIPE as failure.)
    at="$(LC_ALL=C grep -aboP -m 1 '\xfd7zXZ\x00' "$img" | cut -d: -f1)"
    if [[ -n $at ]]; then
        xz -dc --single-stream <(tail -c +$((at + 1)) "$img") >"$out" 2>/dev/null || return 1
    else
        at="$(LC_ALL=C grep -aboP -m 1 '\x28\xb5\x2f\xfd' "$img" | cut -d: -f1)"
        [[ -n $at ]] || return 1
        # zstd complains about the bzImage's trailing bytes after the frame.
        zstd -qdc <(tail -c +$((at + 1)) "$img") >"$out" 2>/dev/null || [[ -s $out ]] || return 1
    fi
    [[ "$(file -b "$out")" == "ELF 64-bit"* ]] || return 1
    readelf -nW "$out" 2>/dev/null | grep -q 'Xen.*0x00000012' || return 1
    # Much of it is zeros (.bss is stored): keep those as holes.
    fallocate --dig-holes "$out" 2>/dev/null || true
    chmod 0644 "$out"
}

# --- 2. Agent ----------------------------------------------------------------
log "building sandbox-agent (static)"
AGENT_BIN="$(static_rust_bin guest-agent sandbox-agent)"

# --- 3. Up to date? ----------------------------------------------------------
FINAL="$IMAGE/vm"
fingerprint() {
    {
        echo "script $(sha256sum <"${BASH_SOURCE[0]}" | cut -d' ' -f1)"
        echo "lib $(sha256sum <"$IMAGES_DIR/lib.sh" | cut -d' ' -f1)"
        echo "agent $(sha256sum <"$AGENT_BIN" | cut -d' ' -f1)"
        echo "kernel $KVER $(sha256sum <"$KERNEL" | cut -d' ' -f1)"
        local m
        for m in "${ORDER[@]}"; do echo "module $m $(sha256sum <"$MODDIR/$m" | cut -d' ' -f1)"; done
        # image.json changes with every build of the image (built_at).
        echo "image $(sha256sum <"$IMAGE/image.json" | cut -d' ' -f1)"
        echo "epoch $SOURCE_DATE_EPOCH compress $COMPRESS kernel ${KERNEL_FORMAT:-pvh}"
    } | sha256sum | cut -d' ' -f1
}
INPUTS="$(fingerprint)"
if [[ -z ${FORCE:-} && -f $FINAL/vm.json && $(cat "$FINAL/inputs.sha256" 2>/dev/null) == "$INPUTS" ]]; then
    log "up to date ($FINAL); FORCE=1 rebuilds"
    exit 0
fi

# --- 4. Staging ---------------------------------------------------------------
for stale in "$IMAGE/.vm.tmp."* "$IMAGE/.vm.old."*; do
    [[ -e $stale ]] && remove_tree "$stale"
done
STAGING="$(mktemp -d "$IMAGE/.vm.tmp.XXXXXX")"
trap '[[ -n $STAGING ]] && remove_tree "$STAGING"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
chmod 0755 "$STAGING"

install -m 0644 "$KERNEL" "$STAGING/vmlinuz"
# The kernel QEMU boots. The bzImage decompresses itself (xz on Debian), which
# takes ~4 s of every boot under TCG; the same kernel as an uncompressed ELF
# with a PVH entry point boots straight away. So ship that too, and name it in
# vm.json, unless it cannot be extracted (or KERNEL_FORMAT=bzimage).
BOOT_KERNEL=vmlinuz
if [[ ${KERNEL_FORMAT:-pvh} == pvh ]]; then
    if extract_vmlinux "$KERNEL" "$STAGING/vmlinux"; then
        BOOT_KERNEL=vmlinux
    else
        log "warning: no PVH-capable ELF kernel could be extracted from $KERNEL; booting the bzImage"
        rm -f "$STAGING/vmlinux"
    fi
fi
log "boot kernel: $BOOT_KERNEL"

# --- 5. Initramfs -----------------------------------------------------------
INIT="$STAGING/initramfs"
mkdir -p "$INIT/modules"
# Debug info is 80% of the binary and useless in the guest; symbols stay for
# panic backtraces.
strip --strip-debug -o "$INIT/init" "$AGENT_BIN"
chmod 0755 "$INIT/init"
AGENT_SHA="$(sha256sum <"$INIT/init" | cut -d' ' -f1)"
: >"$INIT/modules.order"
for m in "${ORDER[@]}"; do
    base="$(basename "$m")"
    base=${base%.xz}
    base=${base%.zst}
    base=${base%.gz}
    case $m in
        *.ko) cp "$MODDIR/$m" "$INIT/modules/$base.in" ;;
        *.ko.xz) xz -dc "$MODDIR/$m" >"$INIT/modules/$base.in" ;;
        *.ko.zst) zstd -qdc "$MODDIR/$m" >"$INIT/modules/$base.in" ;;
        *.ko.gz) gzip -dc "$MODDIR/$m" >"$INIT/modules/$base.in" ;;
        *) die "unknown module file $m" ;;
    esac
    # Without their signatures (what INSTALL_MOD_STRIP does): verifying them costs
    # ~130 ms of every boot under TCG, and nothing in the guest enforces them.
    strip --strip-debug -o "$INIT/modules/$base" "$INIT/modules/$base.in"
    rm -f "$INIT/modules/$base.in"
    chmod 0644 "$INIT/modules/$base"
    echo "$base" >>"$INIT/modules.order"
done
log "initramfs modules: $(tr '\n' ' ' <"$INIT/modules.order")"
find "$INIT" -mindepth 1 -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$INIT" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort \
    | cpio --quiet -o -H newc --reproducible -R 0:0 >"$STAGING/initramfs.cpio")
if [[ $COMPRESS == gzip ]]; then
    gzip -n -9 -c "$STAGING/initramfs.cpio" >"$STAGING/initramfs.img"
    rm -f "$STAGING/initramfs.cpio"
else
    mv "$STAGING/initramfs.cpio" "$STAGING/initramfs.img"
fi
chmod 0644 "$STAGING/initramfs.img"
rm -rf "$INIT"

# --- 6. Disk ------------------------------------------------------------------
# Content plus 15% and 48 MiB (inode tables, the journal, room for the first
# writes), in whole 4 MiB. The agent grows the filesystem to the overlay's size
# at boot, so this is only the floor of a sandbox's disk.
content_kib="$(du -sk --one-file-system "$IMAGE/rootfs" | cut -f1)"
files="$(find "$IMAGE/rootfs" -xdev | wc -l)"
size_mib=$(((content_kib * 115 / 100 / 1024 + 48 + 3) / 4 * 4))
DISK_BYTES=$((size_mib << 20))
# Fixed per image, so the same rootfs gives the same bytes.
uuid_hex="$(printf 'sandboxd-vm-%s' "$NAME" | sha256sum | cut -c1-32)"
UUID="${uuid_hex:0:8}-${uuid_hex:8:4}-4${uuid_hex:13:3}-a${uuid_hex:17:3}-${uuid_hex:20:12}"
RAW="$STAGING/rootfs.raw"
truncate -s "$DISK_BYTES" "$RAW"
# -m 0: everything in the guest runs as root; a reserve would only shrink the
#   sandbox's disk. -i 16384: the default ratio even below 512 MiB, where
#   mke2fs's "small" type would quadruple the inode tables of every group the
#   agent adds when growing. lazy_itable_init=0: zero the inode tables now, so
#   the guest kernel does not do it in the background on every boot.
# The journal stays: a snapshot taken while frozen is then a clean filesystem,
#   and a VM killed mid-write replays instead of booting on a damaged one; it
#   costs nothing measurable at boot (see images/README.md).
if ! E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mkfs.ext4 -q -F -b 4096 -i 16384 -I 256 -m 0 \
    -L "$NAME" -U "$UUID" \
    -E "hash_seed=$UUID,lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0" \
    -d "$IMAGE/rootfs" "$RAW" >"$STAGING/mkfs.out" 2>&1; then
    cat "$STAGING/mkfs.out" >&2
    die "mkfs.ext4 failed for $content_kib KiB in $files files on ${size_mib} MiB"
fi
rm -f "$STAGING/mkfs.out"
# mkfs.ext4 -d copies each file's atime and ctime, which change whenever the
# rootfs is read (a sandbox, a smoke test) or touched: set both to the epoch
# so the disk depends on content, modes and mtimes only.
(cd "$IMAGE/rootfs" && find . -xdev -printf '%P\n') \
    | awk -v e="$SOURCE_DATE_EPOCH" 'index($0, "\"") == 0 { p = "/" $0
        printf "sif \"%s\" atime @%d\nsif \"%s\" atime_extra 0\n", p, e, p
        printf "sif \"%s\" ctime @%d\nsif \"%s\" ctime_extra 0\n", p, e, p }' >"$STAGING/times.cmds"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH debugfs -w -f "$STAGING/times.cmds" "$RAW" >/dev/null 2>&1 \
    || die "debugfs could not normalize the timestamps on the disk"
rm -f "$STAGING/times.cmds"
qemu-img convert -q -f raw -O qcow2 "$RAW" "$STAGING/rootfs.qcow2"
rm -f "$RAW"
chmod 0444 "$STAGING/rootfs.qcow2"
log "disk: $content_kib KiB in $files files -> ext4 of $size_mib MiB, qcow2 of $(human_size "$STAGING/rootfs.qcow2")"

# --- 7. vm.json last, then into place ---------------------------------------
echo "$INPUTS" >"$STAGING/inputs.sha256"
{
    printf '{\n'
    printf '  "kernel": "%s",\n' "$BOOT_KERNEL"
    printf '  "kernel_version": %s,\n' "$(json_string "$KVER")"
    printf '  "initramfs": "initramfs.img",\n'
    printf '  "disk": "rootfs.qcow2",\n'
    printf '  "disk_bytes": %d,\n' "$DISK_BYTES"
    printf '  "agent_sha256": %s\n' "$(json_string "$AGENT_SHA")"
    printf '}\n'
} >"$STAGING/vm.json.tmp"
chmod 0644 "$STAGING/vm.json.tmp"
mv -f -- "$STAGING/vm.json.tmp" "$STAGING/vm.json"

if [[ -e $FINAL ]]; then
    # Running VMs keep their open files, and sandboxd links each base disk into
    # its own state dir, so the old build can go at once.
    old="$IMAGE/.vm.old.$$"
    mv -T -- "$FINAL" "$old"
    mv -T -- "$STAGING" "$FINAL"
    STAGING=""
    remove_tree "$old"
else
    mv -T -- "$STAGING" "$FINAL"
    STAGING=""
fi
log "ready: $FINAL ($(human_size "$FINAL")) in ${SECONDS}s"
