//! The exec runtime every tier shares, so "the same semantics on every tier" holds by
//! construction rather than by three copies kept in step:
//!
//! - [`spawn`]: fork/exec of one command (PATH lookup, session, cgroup, stdio, descriptors) and
//!   why it could not start, as a typed [`spawn::Stage`] with its exit code and sentence. The
//!   process tier's init, the microVM guest agent and the container tier's exec helper use it.
//! - [`outcome`]: the one table that turns how a main process ended (and why the runtime stopped
//!   waiting) into the status, exit code and signal of an `ExecResult`.
//! - [`capture`]: bounded output capture with spill files, and the constants execs share
//!   (default `PATH`, spill directory).
//! - [`pty`]: pseudo-terminals for interactive execs, opened in the devpts the command sees.
//! - [`sys`]: file access confined to a sandbox's root (`openat2` with `RESOLVE_IN_ROOT`), used by
//!   the daemon's file API on the process and container tiers and by the guest agent.
//! - [`etc`]: `/etc/hostname` and `/etc/hosts` naming the sandbox, written at every start
//!   without following anything the sandbox planted there.
//! - [`archive`]: directories in and out of a sandbox as tar streams, on top of [`sys`], with
//!   every entry confined to the sandbox's root and nothing followed below the chosen path.
//!
//! - [`user`]: the user an exec runs as, resolved against the sandbox's own passwd and group.
//!
//! It has no async runtime and few dependencies: the guest agent links it into a static binary.

pub mod archive;
pub mod capture;
pub mod etc;
pub mod outcome;
pub mod pty;
pub mod serve;
pub mod spawn;
pub mod sys;
pub mod user;
