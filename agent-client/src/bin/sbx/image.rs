//! `sbx image ls`, `get`, `rm`, `import` and `build`.

use std::io::Seek;
use std::path::Path;

use agent_client::proto::{BuildImageHeader, ImageInfo, ImageProgress};
use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::cli::ImageCommand;
use crate::{json, output, Ctx};

/// Runs one `sbx image` command.
pub async fn image(ctx: &Ctx, command: ImageCommand) -> Result<u8> {
    match command {
        ImageCommand::Ls => list(ctx).await,
        ImageCommand::Get { name } => get(ctx, name).await,
        ImageCommand::Rm { name } => remove(ctx, name).await,
        ImageCommand::Import { source, name } => {
            import(ctx, &source, name.unwrap_or_default()).await
        }
        ImageCommand::Build {
            name,
            dockerfile,
            build_args,
            network,
            allow,
            dir,
        } => {
            let network = super::cli::network_policy(network, &allow);
            build(ctx, name, dockerfile, build_args, network, &dir).await
        }
    }
}

/// The tiers that can run an image, lower-case and comma-separated (`-` for none).
fn tiers(info: &ImageInfo) -> String {
    let names: Vec<String> = info
        .ready_tiers
        .iter()
        .map(|t| output::isolation(*t))
        .collect();
    output::or_dash(&names.join(","))
}

/// The first 12 hex digits of a digest.
fn short(digest: &str) -> String {
    digest
        .trim_start_matches("sha256:")
        .chars()
        .take(12)
        .collect()
}

async fn list(ctx: &Ctx) -> Result<u8> {
    let listed = ctx.client().await?.list_images_fleet().await?;
    // A fleet node that did not answer: its images are missing, which must not pass unseen.
    for n in &listed.unreachable_nodes {
        output::stderr(
            format!(
                "sbx: node {} did not answer ({}): its images are not listed\n",
                n.node, n.error
            )
            .as_bytes(),
        )?;
    }
    let images = listed.images;
    if ctx.json {
        output::json(&images.iter().map(json::image).collect())?;
        return Ok(0);
    }
    // A fleet's list names the nodes holding each image; a lone daemon's names none.
    let fleet = images.iter().any(|i| !i.nodes.is_empty());
    let rows: Vec<Vec<String>> = images
        .iter()
        .map(|i| {
            let mut row = vec![
                i.name.clone(),
                output::or_dash(&short(&i.digest)),
                output::size(i.size_bytes),
                output::time(i.created_at.as_ref()),
                tiers(i),
            ];
            if fleet {
                row.push(i.nodes.join(","));
            }
            row
        })
        .collect();
    let mut head = vec!["NAME", "DIGEST", "SIZE", "CREATED", "TIERS"];
    if fleet {
        head.push("NODES");
    }
    output::stdout(output::table(&head, &rows).as_bytes())?;
    Ok(0)
}

async fn get(ctx: &Ctx, name: String) -> Result<u8> {
    let info = ctx.client().await?.get_image(name).await?;
    if ctx.json {
        output::json(&json::image(&info))?;
        return Ok(0);
    }
    let mut env: Vec<String> = info.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.sort();
    let rows = [
        ("NAME", info.name.clone()),
        ("DIGEST", info.digest.clone()),
        ("SIZE", output::size(info.size_bytes)),
        ("CREATED", output::time(info.created_at.as_ref())),
        ("SOURCE", output::or_dash(&info.source)),
        ("IMPORTED", info.imported.to_string()),
        ("TIERS", tiers(&info)),
        ("WORKDIR", output::or_dash(&info.workdir)),
        ("USER", output::or_dash(&info.user)),
        ("ENTRYPOINT", output::or_dash(&info.entrypoint.join(" "))),
        ("CMD", output::or_dash(&info.cmd.join(" "))),
        ("ENV", output::or_dash(&env.join(" "))),
    ];
    output::stdout(output::fields(&rows).as_bytes())?;
    Ok(0)
}

async fn remove(ctx: &Ctx, name: String) -> Result<u8> {
    let freed = ctx.client().await?.remove_image(name.as_str()).await?;
    if ctx.json {
        output::json(&json!({ "name": name, "removed": true, "freed_bytes": freed }))?;
    }
    Ok(0)
}

/// Prints a progress event on stderr: a build's log lines as they are, the rest as
/// `[phase] message`.
fn show_progress(event: &ImageProgress) {
    let line = if event.phase == "build" {
        format!("{}\n", event.message)
    } else if event.phase == "receive" && event.total_bytes > 0 {
        format!(
            "[{}] {} ({}%)\n",
            event.phase,
            event.message,
            event.bytes.saturating_mul(100) / event.total_bytes
        )
    } else {
        format!("[{}] {}\n", event.phase, event.message)
    };
    let _ = output::stderr(line.as_bytes());
}

/// Prints the imported or built image: its name, or all of it with --json.
fn done(ctx: &Ctx, info: &ImageInfo) -> Result<u8> {
    if ctx.json {
        output::json(&json::image(info))?;
    } else {
        output::line(&info.name)?;
    }
    Ok(0)
}

async fn import(ctx: &Ctx, source: &str, name: String) -> Result<u8> {
    if let Some(reference) = source.strip_prefix("docker:") {
        if reference.is_empty() {
            bail!("import: docker: needs an image reference, e.g. docker:debian:bookworm");
        }
        let client = ctx.client().await?;
        let info = client
            .import_docker_image(reference, name, show_progress)
            .await?;
        return done(ctx, &info);
    }
    // Checked before dialling, so a typo is reported as such.
    let path = Path::new(source);
    let file =
        std::fs::File::open(path).with_context(|| format!("import: cannot open {source}"))?;
    let size = file
        .metadata()
        .with_context(|| format!("import: cannot read {source}"))?
        .len();
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let client = ctx.client().await?;
    let info = client
        .import_image_archive(
            name,
            file_name,
            size,
            tokio::fs::File::from_std(file),
            show_progress,
        )
        .await?;
    done(ctx, &info)
}

async fn build(
    ctx: &Ctx,
    name: String,
    dockerfile: String,
    build_args: Vec<(String, String)>,
    network: Option<agent_client::proto::NetworkPolicy>,
    dir: &Path,
) -> Result<u8> {
    if !dir.join(&dockerfile).is_file() {
        bail!(
            "build: {} has no {dockerfile} (pass -f for another Dockerfile)",
            dir.display()
        );
    }
    // The context is packed into a temporary file first: its size is then known (progress)
    // and a file that changes while it is sent cannot break the stream.
    let mut context = tempfile::tempfile().context("build: cannot create a temporary file")?;
    let report = agent_client::images::pack_context(dir, &dockerfile, &mut context)
        .with_context(|| format!("build: cannot pack {}", dir.display()))?;
    let size = context
        .stream_position()
        .context("build: cannot measure the context")?;
    context
        .rewind()
        .context("build: cannot read the context back")?;
    output::stderr(
        format!(
            "[context] {} files, {} sent to the daemon\n",
            report.files,
            output::size(size)
        )
        .as_bytes(),
    )?;
    let header = BuildImageHeader {
        name,
        dockerfile,
        build_args: build_args.into_iter().collect(),
        context_size_bytes: size,
        network,
    };
    let client = ctx.client().await?;
    let info = client
        .build_image(header, tokio::fs::File::from_std(context), show_progress)
        .await?;
    done(ctx, &info)
}
