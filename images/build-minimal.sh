#!/usr/bin/env bash
#
# images/build-minimal.sh [OUT_DIR] - build the "minimal" image.
#
# Produces OUT_DIR/minimal/{rootfs/,image.json} (OUT_DIR defaults to
# images/build). The rootfs is a single static busybox (from Debian's
# busybox-static) plus one relative symlink per applet and a tiny /etc. It
# has no package manager and no libc, builds in about a second without network
# (when busybox-static is installed), and is what the daemon's tests use.
#
# Busybox source: /bin/busybox of the installed busybox-static package; if the
# package is not installed, `apt-get download busybox-static` into a temp dir
# and unpack it with dpkg-deb -x (no root, no system install needed).
#
# Idempotent: builds into a staging dir next to the output and renames it into
# place, replacing an older build (see lib.sh).
set -euo pipefail
umask 022

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SECONDS=0
image_begin minimal "${1:-}"
ROOTFS="$STAGING/rootfs"

# --- 1. Find a static busybox --------------------------------------------
if dpkg -s busybox-static 2>/dev/null | grep -q '^Status: install ok installed' \
    && [[ -x /bin/busybox ]]; then
    BB_VERSION="$(dpkg-query -W -f '${Version}' busybox-static)"
    install -m 0755 /bin/busybox "$ROOTFS/.busybox"
    log "using /bin/busybox from installed busybox-static $BB_VERSION"
else
    log "busybox-static not installed; fetching it with apt-get download"
    DL="$STAGING/.download"
    mkdir "$DL"
    apt_opts=(-q)
    # apt's download sandbox user (_apt) cannot write into our 0700 dir.
    if ((EUID == 0)); then apt_opts+=(-o APT::Sandbox::User=root); fi
    (cd "$DL" && apt-get "${apt_opts[@]}" download busybox-static) \
        || die "apt-get download busybox-static failed (run 'apt-get update' first?)"
    debs=("$DL"/busybox-static_*.deb)
    [[ -f ${debs[0]} ]] || die "no busybox-static .deb was downloaded"
    BB_VERSION="$(dpkg-deb -f "${debs[0]}" Version)"
    dpkg-deb -x "${debs[0]}" "$DL/x"
    install -m 0755 "$DL/x/bin/busybox" "$ROOTFS/.busybox"
    rm -rf -- "$DL"
    log "using busybox from downloaded busybox-static $BB_VERSION"
fi

# --- 2. Directory skeleton -----------------------------------------------
for d in bin sbin usr/bin usr/sbin etc home proc sys dev workspace var; do
    mkdir -p "$ROOTFS/$d"
done
mkdir -m 0700 "$ROOTFS/root"
mkdir -p "$ROOTFS/tmp" "$ROOTFS/var/tmp"
chmod 1777 "$ROOTFS/tmp" "$ROOTFS/var/tmp"
mv "$ROOTFS/.busybox" "$ROOTFS/bin/busybox"

# --- 3. One relative symlink per applet ----------------------------------
# --list-full prints paths relative to / (bin/ls, usr/bin/awk, linuxrc, ...).
mapfile -t applets < <("$ROOTFS/bin/busybox" --list-full)
((${#applets[@]} > 0)) || die "busybox --list-full printed nothing"
links=0
for path in "${applets[@]}"; do
    [[ -n $path && $path != bin/busybox ]] || continue
    dir=${path%/*}
    if [[ $dir == "$path" ]]; then
        dir=.
        target=bin/busybox
    elif [[ $dir == bin ]]; then
        target=busybox
    else
        # One "../" per component of the link's directory (usr/bin -> ../../).
        IFS=/ read -ra parts <<<"$dir"
        target=""
        for _ in "${parts[@]}"; do target+="../"; done
        target+="bin/busybox"
    fi
    mkdir -p "$ROOTFS/$dir"
    if [[ ! -e $ROOTFS/$path && ! -L $ROOTFS/$path ]]; then
        ln -s "$target" "$ROOTFS/$path"
        links=$((links + 1))
    fi
done
log "created $links applet symlinks -> /bin/busybox"

# Debian's busybox is built without the nohup applet; provide a tiny
# POSIX-sh equivalent (ignore SIGHUP, move terminal output to nohup.out).
if [[ ! -e $ROOTFS/usr/bin/nohup ]]; then
    cat >"$ROOTFS/usr/bin/nohup" <<'EOF'
#!/bin/sh
# nohup for the minimal image (Debian's busybox has no nohup applet).
if [ "$#" -eq 0 ]; then
    echo "usage: nohup COMMAND [ARG]..." >&2
    exit 125
fi
trap '' HUP
[ -t 0 ] && exec </dev/null
if [ -t 1 ]; then
    out=nohup.out
    ( : >>"$out" ) 2>/dev/null || out="${HOME:-/}/nohup.out"
    echo "nohup: appending output to '$out'" >&2
    exec >>"$out"
fi
[ -t 2 ] && exec 2>&1
exec "$@"
EOF
    chmod 0755 "$ROOTFS/usr/bin/nohup"
    log "added /usr/bin/nohup shell wrapper (not a busybox applet in Debian)"
fi

# --- 4. Minimal /etc -----------------------------------------------------
cat >"$ROOTFS/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$ROOTFS/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
echo sandbox >"$ROOTFS/etc/hostname"
cat >"$ROOTFS/etc/hosts" <<'EOF'
127.0.0.1	localhost
::1		localhost ip6-localhost ip6-loopback
EOF
: >"$ROOTFS/etc/resolv.conf"
log "wrote /etc/{passwd,group,hostname,hosts,resolv.conf}"

# --- 5. Smoke test -------------------------------------------------------
"$ROOTFS/bin/busybox" true || die "busybox does not run on this host"
if ((EUID == 0)) && command -v chroot >/dev/null; then
    out="$(chroot "$ROOTFS" /bin/sh -c 'echo ok')" || die "chroot smoke test failed"
    [[ $out == ok ]] || die "chroot smoke test printed '$out'"
    log "chroot smoke test: /bin/sh -c 'echo ok' -> ok"
else
    log "warning: not root, files are owned by uid $EUID and the chroot test was skipped"
fi

image_finish "debian:busybox-static=$BB_VERSION"
log "done in ${SECONDS}s"
