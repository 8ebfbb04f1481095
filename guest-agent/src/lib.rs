//! The host<->guest wire protocol of the microVM tier, spoken over the VM's virtio-serial port by
//! sandboxd and the guest agent. What runs a command on every tier (spawn, the classification of
//! an exec's end, output capture) is the `sandbox-exec` crate.
//!
//! The agent binary (`sandbox-agent`, `src/main.rs`) is built statically into each VM's initramfs.

pub mod protocol;
