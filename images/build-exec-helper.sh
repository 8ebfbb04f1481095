#!/usr/bin/env bash
# images/build-exec-helper.sh OUT_DIR - builds `sandbox-exec`, the container
# tier's exec helper (exec/src/bin/sandbox-exec.rs), statically linked, and
# installs it as OUT_DIR/.tools/sandbox-exec, where sandboxd looks for it (next
# to the images it serves). sandboxd bind-mounts it read-only into every
# container (the directory, at /.sandboxd) and starts each command through it.
#
# Cheap when nothing changed (cargo is incremental; the file is replaced only
# when its bytes differ). Env: CARGO=cargo, AGENT_TARGET_DIR=DIR.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
IMAGE_NAME=exec-helper

[[ $# -eq 1 ]] || die "usage: $0 OUT_DIR"
OUT="$1/.tools"
mkdir -p -- "$OUT"
BIN="$(static_rust_bin sandbox-exec sandbox-exec)"
# Stripped (the release profile keeps line tables): it is mapped into every exec.
install -s -m 0755 -- "$BIN" "$OUT/.sandbox-exec.tmp"
if cmp -s -- "$OUT/.sandbox-exec.tmp" "$OUT/sandbox-exec"; then
    rm -f -- "$OUT/.sandbox-exec.tmp"
else
    # Rename into place: a container being created never sees half a file.
    mv -f -- "$OUT/.sandbox-exec.tmp" "$OUT/sandbox-exec"
    log "installed $OUT/sandbox-exec"
fi
