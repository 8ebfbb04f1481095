//! RUN steps of builds (see `images::steps`): each one runs in a container sandbox made from
//! the Docker image the build has reached, confined exactly as every container sandbox is (the
//! seccomp profile, capabilities, `no-new-privileges`, read-only paths, memory, CPU and pids
//! limits, the network its policy gives through the egress filter), its command started by the
//! exec helper like any exec. What it wrote is then committed as the build's next image.
//!
//! The commit keeps the image's own configuration: the build args a step saw were the exec's
//! environment, never the container's, so none of them ends up in the image; the keepalive is
//! the container's entrypoint with an empty command, so an image without a CMD gets none of
//! ours (Docker fills an empty CMD of a commit from the container's).

use std::collections::HashMap;

use bollard::models::ContainerConfig;
use bollard::query_parameters::CommitContainerOptions;

use super::docker::api_error;
use super::setup::Role;
use super::{net, Inner};
use crate::backend::{BackendError, SandboxSpec};
use crate::ids::SandboxId;

impl Inner {
    /// Makes sandbox `spec` from the Docker image `image` (a build's image so far).
    pub(super) async fn create_build_step(self: &std::sync::Arc<Self>, spec: &SandboxSpec, image: &str) -> Result<(), BackendError> {
        let docker = self.docker()?;
        let info = docker.inspect_image(image).await.map_err(|e| api_error(format!("inspecting image {image}"), e))?;
        // An image with a USER would start the keepalive as that user; it runs as root instead
        // (the step's command still runs as the USER). Without one, the container names no
        // user, so a commit gives the image none either.
        let as_root = info.config.and_then(|c| c.user).is_some_and(|u| !u.is_empty());
        let sb = self.launch(spec, &Role::BuildStep { image: image.to_string(), as_root }, None).await?;
        if let Err(e) = net::attach(self, &sb).await {
            self.tear_down(&sb, "network setup failed").await;
            return Err(e);
        }
        self.insert_sandbox(sb)
    }

    /// Stops build-step sandbox `sandbox` and commits its filesystem as a new Docker image,
    /// tagged `repo:tag`, with the configuration of image `config_of`; the container goes.
    /// Returns the new image's ID.
    pub(super) async fn commit_build_step(&self, sandbox: &SandboxId, config_of: &str, repo: &str, tag: &str) -> Result<String, BackendError> {
        let docker = self.docker()?;
        let sb = self.take_sandbox(sandbox).ok_or_else(|| BackendError::NoSuchSandbox(sandbox.clone()))?;
        // Nothing of the step runs on (a daemonized leftover) while its files are committed.
        sb.mark_lost("the build step ended");
        net::detach(self, &sb).await;
        sb.kill_everything().await;
        sb.remove_exec_cgroups();
        let result = async {
            let info = docker.inspect_image(config_of).await.map_err(|e| api_error(format!("inspecting image {config_of}"), e))?;
            let c = info.config.unwrap_or_default();
            let config = ContainerConfig {
                user: c.user,
                exposed_ports: c.exposed_ports,
                env: c.env,
                // Never absent: Docker would fill an absent one from the container's.
                cmd: Some(c.cmd.unwrap_or_default()),
                entrypoint: Some(c.entrypoint.unwrap_or_default()),
                healthcheck: c.healthcheck,
                args_escaped: c.args_escaped,
                volumes: c.volumes,
                working_dir: c.working_dir,
                on_build: c.on_build,
                labels: Some(c.labels.unwrap_or_else(HashMap::new)),
                stop_signal: c.stop_signal,
                shell: c.shell,
                ..Default::default()
            };
            let options = CommitContainerOptions {
                container: Some(sb.container_id.clone()),
                repo: Some(repo.to_string()),
                tag: Some(tag.to_string()),
                comment: Some("a RUN step of a sandboxd build".to_string()),
                pause: false,
                ..Default::default()
            };
            let id = docker.commit_container(options, config).await.map_err(|e| api_error(format!("committing build step {sandbox}"), e))?;
            Ok(id.id)
        }
        .await;
        self.remove_container(&sb.container_id).await;
        result
    }
}
