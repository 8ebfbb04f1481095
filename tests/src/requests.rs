//! Requests the suites send most.

use agent_client::proto::{CreateSandboxRequest, Isolation};

/// A CreateSandboxRequest for `isolation` with the given image and defaults otherwise.
pub fn sandbox_request(isolation: Isolation, image: &str) -> CreateSandboxRequest {
    CreateSandboxRequest { isolation: isolation as i32, image: image.to_string(), ..Default::default() }
}

/// A CreateSandboxRequest for the process tier with the given image and defaults otherwise.
pub fn process_sandbox(image: &str) -> CreateSandboxRequest {
    sandbox_request(Isolation::Process, image)
}
