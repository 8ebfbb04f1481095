//! `sandbox-agent`: PID 1 of a sandboxd microVM. Placeholder until the agent lands.
fn main() {}
