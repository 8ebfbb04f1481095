//! Typed async client for `sandboxd`, the sandbox daemon.
//!
//! [`Client`] wraps the generated gRPC stub of the `sandbox.v1.SandboxService` API with one method
//! per RPC, plain Rust inputs and a single [`Error`] type. The protobuf messages are re-exported as
//! [`proto`], so callers build requests and read results without depending on `sandbox-proto`
//! themselves.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agent_client::Error> {
//! use agent_client::{exec_request, Client};
//!
//! let client = Client::from_env().await?;
//! let sandbox = client.create(Default::default()).await?;
//! let result = client.exec(exec_request(&sandbox.id, ["echo", "hello"])).await?;
//! assert_eq!(result.stdout, b"hello\n");
//! client.destroy(&sandbox.id).await?;
//! # Ok(())
//! # }
//! ```
//!
//! Files of any size, directories and interactive sessions go through streams:
//! [`Client::upload_file`], [`Client::download_file`], [`Client::upload_archive`],
//! [`Client::download_archive`] (with [`archive`] to build and safely extract tar streams) and
//! [`Client::exec_session`] (see [`session`]).
//!
//! The `sbx` command line (in `src/bin/`) is built on this library and holds every CLI concern;
//! nothing here prints or exits.

#![warn(missing_docs)]

pub mod address;
pub mod agent;
pub mod archive;
pub mod client;
pub mod error;
pub mod images;
pub mod session;
pub mod transfer;

pub use address::Address;
pub use client::{exec_request, AuthInterceptor, Client, ExecStream, RawClient};
pub use error::{code_name, Error, Result};
pub use session::{ExecSession, SessionEvent, SessionEvents, SessionInput};
pub use transfer::FileTransfer;

/// The generated `sandbox.v1` messages and enums, re-exported from `sandbox-proto`.
pub use sandbox_proto::v1 as proto;

/// Environment variable naming the daemon's address (see [`Address::parse`]).
pub const SOCKET_ENV: &str = "SANDBOXD_SOCKET";

/// Environment variable holding an optional bearer token sent with every call.
pub const TOKEN_ENV: &str = "SANDBOXD_TOKEN";

/// The socket `make run` starts the daemon on, under the current directory (a checkout).
pub const DEFAULT_SOCKET: &str = "unix://./.sandboxd/sandboxd.sock";

/// The socket a bare `sandboxd` (a service, the example config) listens on.
pub const SYSTEM_SOCKET: &str = "unix:///run/sandboxd/sandboxd.sock";

/// The address used when neither `--socket` nor [`SOCKET_ENV`] says: `make run`'s socket
/// ([`DEFAULT_SOCKET`]) when there is one under the current directory, else the system
/// daemon's ([`SYSTEM_SOCKET`]), so `sbx` finds the daemon both in a checkout and on a host
/// running it as a service.
pub fn default_socket() -> &'static str {
    if std::path::Path::new("./.sandboxd/sandboxd.sock").exists() {
        DEFAULT_SOCKET
    } else {
        SYSTEM_SOCKET
    }
}
