//! Test-only crate: `cargo test -p sandboxd-k8s-check` renders every overlay of
//! `deploy/kubernetes/` with `kubectl kustomize` and checks each document as the typed
//! Kubernetes object of its kind (`tests/render.rs`). Nothing here is built into the daemon.
