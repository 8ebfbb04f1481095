#!/usr/bin/env bash
#
# images/build-debian.sh [OUT_DIR] - build the "debian" image.
#
# Produces OUT_DIR/debian/{rootfs/,image.json} (OUT_DIR defaults to
# images/build): a Debian bookworm minbase rootfs with the toolchain an agent's
# typical `pip install` or `make` needs: python3 with pip and venv (and pytest
# with pytest-xdist), bash, git, procps (ps, top, kill), build-essential (gcc,
# g++, make, libc headers), python3-dev, ca-certificates.
#
# The rootfs comes from debootstrap, pointed at the same Debian mirror this
# host's apt uses (read from /etc/apt/sources.list{,.d} via apt itself), so
# it works on machines whose only way out is that mirror or a proxy of it.
# Apt's http(s) proxy setting, if any, is passed on to debootstrap too.
#
# Environment overrides:
#   MIRROR=URL     use this mirror instead of the one from the apt sources
#   SUITE=NAME     Debian suite (default: bookworm)
#
# Needs root (debootstrap) and the debootstrap package (see images/deps.sh).
# Takes a few minutes; builds into a staging dir next to the output and
# renames it into place, replacing an older build (see lib.sh).
set -euo pipefail
umask 022

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SUITE=${SUITE:-bookworm}
INCLUDE=python3,python3-pip,python3-venv,python3-dev,python3-pytest,python3-pytest-xdist,bash,git,coreutils,procps,build-essential,ca-certificates
IMAGE_HOSTNAME=sandbox

# Print the URL of the Debian archive the host's apt uses for $SUITE.
# `apt-get indextargets` lists what `apt-get update` would fetch, parsed by apt
# itself, so one-line (.list) and deb822 (.sources) files both work.
detect_mirror() {
    local targets
    # shellcheck disable=SC2016 # $(...) here is apt's format syntax, not ours
    targets="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 2>/dev/null)" \
        || return 1
    # Prefer an exact suite match for "main"; otherwise any main suite that is
    # not a security/updates/backports pocket (e.g. "stable").
    awk -v suite="$SUITE" '
        $1 !~ /^(https?|file):/ { next }
        $3 != "main" { next }
        $2 == suite { print $1; found = 1; exit }
        !fallback && $2 !~ /-(security|updates|backports|proposed-updates)$/ \
            && $2 !~ /\// { fallback = $1 }
        END { if (!found && fallback) print fallback }
    ' <<<"$targets" | sed 's|/*$||'
}

# Export apt's configured http/https proxy (if any) for debootstrap's wget.
export_apt_proxy() {
    local APT_HTTP_PROXY="" APT_HTTPS_PROXY=""
    eval "$(apt-config shell APT_HTTP_PROXY Acquire::http::Proxy APT_HTTPS_PROXY Acquire::https::Proxy)"
    if [[ -n $APT_HTTP_PROXY && $APT_HTTP_PROXY != DIRECT && -z ${http_proxy:-} ]]; then
        export http_proxy=$APT_HTTP_PROXY
        log "using apt's http proxy $http_proxy"
    fi
    if [[ -n $APT_HTTPS_PROXY && $APT_HTTPS_PROXY != DIRECT && -z ${https_proxy:-} ]]; then
        export https_proxy=$APT_HTTPS_PROXY
        log "using apt's https proxy $https_proxy"
    fi
}

((EUID == 0)) || die "debootstrap needs root; run as root (or with sudo)"
command -v debootstrap >/dev/null || die "debootstrap not installed; run images/deps.sh as root"

SECONDS=0
image_begin debian "${1:-}"
ROOTFS="$STAGING/rootfs"

if [[ -n ${MIRROR:-} ]]; then
    MIRROR=${MIRROR%/}
    log "mirror: $MIRROR (from \$MIRROR)"
else
    MIRROR="$(detect_mirror)" || true
    [[ -n $MIRROR ]] || die "no Debian '$SUITE' main repository found in the apt sources; set MIRROR=URL"
    log "mirror: $MIRROR (from the apt sources)"
fi
export_apt_proxy

# --- 1. debootstrap ------------------------------------------------------
log "debootstrap --variant=minbase --include=$INCLUDE $SUITE (this takes a few minutes)"
if ! debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" \
    >"$STAGING/debootstrap.out" 2>&1; then
    tail -n 30 "$STAGING/debootstrap.out" >&2
    if [[ -f $ROOTFS/debootstrap/debootstrap.log ]]; then
        echo "--- $ROOTFS/debootstrap/debootstrap.log (tail) ---" >&2
        tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
    fi
    die "debootstrap failed"
fi
rm -f -- "$STAGING/debootstrap.out"
log "debootstrap finished after ${SECONDS}s"

# debootstrap unmounts what it mounted, but make sure nothing is left mounted
# inside the rootfs before it becomes a read-only lower layer.
while IFS= read -r mp; do
    [[ -n $mp ]] || continue
    log "unmounting leftover $mp"
    umount -l -- "$mp"
done < <(mounts_under "$ROOTFS")

# --- 2. Trim and configure -----------------------------------------------
rm -f "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/var/cache/apt/archives/partial/* \
    "$ROOTFS"/var/cache/apt/*.bin
rm -rf "${ROOTFS:?}"/var/lib/apt/lists/*
log "cleaned apt caches and package lists"

# debootstrap copies the host's hostname and resolv.conf; replace them. DNS
# is the sandbox runtime's business, so ship an empty resolv.conf.
echo "$IMAGE_HOSTNAME" >"$ROOTFS/etc/hostname"
cat >"$ROOTFS/etc/hosts" <<EOF
127.0.0.1	localhost
127.0.1.1	$IMAGE_HOSTNAME
::1		localhost ip6-localhost ip6-loopback
EOF
rm -f "$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/resolv.conf"
mkdir -p "$ROOTFS/workspace"
log "set /etc/hostname=$IMAGE_HOSTNAME, /etc/hosts, empty /etc/resolv.conf, created /workspace"

# --- 3. Smoke test -------------------------------------------------------
for check in "/bin/bash -c true" "/usr/bin/python3 -c pass" "/usr/bin/git --version" \
    "/usr/bin/python3 -m pip --version" "/usr/bin/python3 -m venv --help" "/usr/bin/python3 -m pytest --version" \
    "/usr/bin/python3 -c __import__('xdist')" "/usr/bin/test -x /usr/bin/ps" "/usr/bin/gcc --version" "/usr/bin/make --version"; do
    # shellcheck disable=SC2086 # split the command string on purpose
    chroot "$ROOTFS" $check >/dev/null || die "smoke test failed: $check"
done
log "smoke test ok: $(chroot "$ROOTFS" python3 --version), $(chroot "$ROOTFS" git --version)"

debootstrap_version="$(dpkg-query -W -f '${Version}' debootstrap 2>/dev/null || echo unknown)"
image_finish "debootstrap $debootstrap_version --variant=minbase --include=$INCLUDE $SUITE $MIRROR"
log "done in ${SECONDS}s"
