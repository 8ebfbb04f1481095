//! What the host (sandboxd) and the microVM guest agent share: the wire protocol spoken over the
//! VM's virtio-serial port, and the bounded output capture both sides of an exec use.
//!
//! This library has no I/O of its own and few dependencies so the daemon can link it; the agent
//! binary (`sandbox-agent`, `src/main.rs`) is built statically into each VM's initramfs.

pub mod capture;
pub mod outcome;
pub mod protocol;
pub mod spawn_failure;
pub mod sys;
