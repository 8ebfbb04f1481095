# shellcheck shell=bash
#
# images/lib.sh - helpers shared by the images/build-*.sh scripts.
#
# Sourced, not executed. It implements the parts of the image contract that
# every builder must get right in the same way:
#   * build into a staging dir next to the output (same filesystem, so the
#     final step is a rename, never a copy),
#   * write image.json as the very last file of the staging dir, then rename
#     the staging dir into place, so <out>/<name>/ is either absent, the old
#     complete image, or the new complete image - never half of one,
#   * clean up the staging dir (unmounting anything left mounted inside it)
#     on any failure,
#   * serialise concurrent builds of the same image with flock.

# Directory holding this file (and the build scripts).
IMAGES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Set by image_begin.
IMAGE_NAME=""
OUT_DIR=""
STAGING=""

log() { printf '[%s] %s\n' "${IMAGE_NAME:-images}" "$*"; }
die() { printf '[%s] error: %s\n' "${IMAGE_NAME:-images}" "$*" >&2; exit 1; }

# json_string STR -> STR as a JSON string literal (quotes included).
json_string() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    s=${s//$'\n'/\\n}
    s=${s//$'\r'/\\r}
    printf '"%s"' "$s"
}

# human_size DIR -> e.g. "412M" (disk usage, not crossing filesystems).
human_size() { du -sxh -- "$1" | cut -f1; }

# Mount points at or below $1 (deepest first), read from /proc/self/mountinfo.
mounts_under() {
    local root=$1
    [[ -r /proc/self/mountinfo ]] || return 0
    # Field 5 is the mount point; mountinfo escapes spaces as \040.
    awk -v root="$root" '{ mp = $5; gsub(/\\040/, " ", mp)
        if (mp == root || index(mp, root "/") == 1) print mp }' \
        /proc/self/mountinfo | sort -r
}

# True if a mount in this namespace refers to a path under $1 (e.g. an overlay
# whose lowerdir is an image rootfs that is about to be replaced).
path_in_use() {
    [[ -r /proc/self/mountinfo ]] && grep -qF -- "$1/" /proc/self/mountinfo
}

# Remove a directory tree safely: unmount leftovers (debootstrap mounts proc
# and sys inside its target), then delete without crossing filesystems.
remove_tree() {
    local dir=$1 mp
    [[ -e $dir ]] || return 0
    while IFS= read -r mp; do
        if [[ -n $mp ]]; then
            umount -l -- "$mp" 2>/dev/null || true
        fi
    done < <(mounts_under "$dir")
    rm -rf --one-file-system -- "$dir"
}

_image_cleanup() {
    local rc=$?
    if [[ -n $STAGING && -e $STAGING ]]; then
        log "cleaning up unfinished build in $STAGING"
        remove_tree "$STAGING" || true
    fi
    return "$rc"
}

# image_begin NAME [OUT_DIR]
# Resolves OUT_DIR (default: images/build next to this file), takes the build
# lock for NAME, removes leftovers of interrupted builds and creates the
# staging dir ($STAGING, with an empty $STAGING/rootfs).
image_begin() {
    IMAGE_NAME=$1
    local out=${2:-$IMAGES_DIR/build}
    mkdir -p -- "$out"
    OUT_DIR="$(cd -- "$out" && pwd -P)"

    local lockfd
    exec {lockfd}>"$OUT_DIR/.$IMAGE_NAME.lock"
    flock -n "$lockfd" || die "another build of '$IMAGE_NAME' holds $OUT_DIR/.$IMAGE_NAME.lock"

    # Leftovers from interrupted runs (we hold the lock, so nobody owns them).
    local stale
    for stale in "$OUT_DIR/.$IMAGE_NAME.tmp."* "$OUT_DIR/.$IMAGE_NAME.old."*; do
        [[ -e $stale ]] || continue
        if [[ $stale == *.old.* ]] && path_in_use "$stale"; then
            continue
        fi
        log "removing leftover $stale"
        remove_tree "$stale"
    done

    trap _image_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    STAGING="$(mktemp -d "$OUT_DIR/.$IMAGE_NAME.tmp.XXXXXX")"
    chmod 0755 "$STAGING"
    mkdir -m 0755 "$STAGING/rootfs"
}

# image_finish SOURCE
# Writes image.json (last file of the image), then renames the staging dir to
# $OUT_DIR/$IMAGE_NAME, replacing an older build. The old build is deleted
# unless a mount still references it (a running sandbox's overlay), in which
# case it is left as .NAME.old.* and removed by a later build.
image_finish() {
    local source=$1
    local final="$OUT_DIR/$IMAGE_NAME"
    local built_at arch
    built_at="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    arch="$(uname -m)"

    {
        printf '{\n'
        printf '  "name": %s,\n' "$(json_string "$IMAGE_NAME")"
        printf '  "built_at": %s,\n' "$(json_string "$built_at")"
        printf '  "source": %s,\n' "$(json_string "$source")"
        printf '  "arch": %s\n' "$(json_string "$arch")"
        printf '}\n'
    } >"$STAGING/image.json.tmp"
    chmod 0644 "$STAGING/image.json.tmp"
    mv -f -- "$STAGING/image.json.tmp" "$STAGING/image.json"

    local old=""
    if [[ -e $final ]]; then
        local in_use=0
        path_in_use "$final" && in_use=1
        old="$OUT_DIR/.$IMAGE_NAME.old.$(date +%s).$$"
        mv -T -- "$final" "$old"
        mv -T -- "$STAGING" "$final"
        STAGING=""
        if ((in_use)); then
            log "previous build is still mounted somewhere; kept as $old"
        else
            remove_tree "$old"
            log "replaced previous build"
        fi
    else
        mv -T -- "$STAGING" "$final"
        STAGING=""
    fi
    log "image ready: $final ($(human_size "$final"))"
}

# static_rust_bin PACKAGE BIN - builds BIN of the workspace's PACKAGE as a
# static executable (for the microVM's initramfs, or to bind-mount into
# containers whose images have no libc of ours) into $AGENT_TARGET_DIR
# (default: target/guest of the repository) and prints its path.
static_rust_bin() {
    local repo triple target_dir bin
    repo="$(cd -- "$IMAGES_DIR/.." && pwd -P)"
    triple=x86_64-unknown-linux-gnu
    target_dir=${AGENT_TARGET_DIR:-$repo/target/guest}
    # --target keeps RUSTFLAGS off build scripts and proc macros (they run on
    # the host and cannot be static); CARGO_ENCODED_RUSTFLAGS would override ours.
    (cd "$repo" && env -u CARGO_ENCODED_RUSTFLAGS RUSTFLAGS="-C target-feature=+crt-static" \
        "${CARGO:-cargo}" build --release --quiet -p "$1" --bin "$2" \
        --target "$triple" --target-dir "$target_dir") >&2 || die "building $2 failed"
    bin="$target_dir/$triple/release/$2"
    case "$(file -b "$bin")" in
        *"statically linked"* | *"static-pie linked"*) ;;
        *) die "$bin is not statically linked: $(file -b "$bin")" ;;
    esac
    printf '%s\n' "$bin"
}
