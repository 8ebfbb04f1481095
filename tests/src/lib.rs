//! Test and benchmark harness: starts the real `sandboxd` binary on a UNIX socket in a temp dir
//! and connects the real client to it ([`Daemon`]), plus what the end-to-end suites
//! (`tests/tests/*.rs`) share: a daemon-and-client [`Harness`], requests they send most, exec
//! helpers that describe a result in full when an assertion fails, bounded waiting ([`within`],
//! [`eventually`]), what the host shows of a daemon (mounts, cgroups, memory, files), hostile
//! probes, checks more than one suite makes (e.g. [`assert_paths_stay_inside`]), and the egress
//! suites' test internet ([`Internet`]).
//!
//! Nothing here skips: a machine that cannot run the daemon (not root, no images built) makes
//! the test fail with a message saying what is missing, because CI — root, with Docker — has
//! everything.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

pub mod browser;
mod checks;
mod daemon;
mod exec;
pub mod fleet;
mod harness;
mod host;
mod internet;
mod probes;
mod report;
mod requests;
mod wait;

pub use agent_client::proto;

pub use checks::{assert_hello_file_reads_back, assert_paths_stay_inside};
pub use daemon::{images_dir, require_environment, run_sbx, sandboxd_bin, sbx_bin, workspace_root, Daemon, TEST_POOL_BYTES};
pub use exec::{assert_exited, describe, exec, held_exec, read_stream, sh, sh_ok, status, tagged_execs_at_once, text, Streamed};
pub use harness::{daemon_with_sandbox, Harness};
pub use host::{
    cgroups_of, dirs_named, find_under, free_port, host_pid_of, mounted, mounts_of, mounts_under, owner_label, proc_status_bytes, remove_containers_of,
    rss_bytes, unique, PeakRss,
};
pub use internet::Internet;
pub use probes::build_probe;
pub use report::replace_section;
pub use requests::{process_sandbox, sandbox_request};
pub use wait::{eventually, within};
