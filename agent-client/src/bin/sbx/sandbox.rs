//! `sbx create`, `fork`, `ls`, `get` and `rm`.

use agent_client::proto::{CreateSandboxRequest, Sandbox};
use anyhow::Result;
use serde_json::json;

use crate::{json, output, Ctx};

/// Creates a sandbox (from a snapshot when the request names one) and prints its id.
pub async fn create(ctx: &Ctx, request: CreateSandboxRequest) -> Result<u8> {
    let sandbox = ctx.client().await?.create(request).await?;
    if ctx.json {
        output::json(&json::sandbox(&sandbox))?;
    } else {
        output::line(&sandbox.id)?;
    }
    Ok(0)
}

/// Lists sandboxes matching every label.
pub async fn list(ctx: &Ctx, labels: Vec<(String, String)>) -> Result<u8> {
    let listed = ctx
        .client()
        .await?
        .list_fleet(labels.into_iter().collect())
        .await?;
    let mut sandboxes = listed.sandboxes;
    // A fleet node that did not answer: its sandboxes are missing, which must not pass unseen.
    for n in &listed.unreachable_nodes {
        output::stderr(
            format!(
                "sbx: node {} did not answer ({}): its sandboxes are not listed\n",
                n.node, n.error
            )
            .as_bytes(),
        )?;
    }
    if ctx.json {
        output::json(&sandboxes.iter().map(json::sandbox).collect())?;
        return Ok(0);
    }
    sandboxes.sort_by(|a, b| {
        let key = |s: &Sandbox| s.created_at.map(|t| (t.seconds, t.nanos));
        key(a).cmp(&key(b)).then_with(|| a.id.cmp(&b.id))
    });
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                output::isolation(s.isolation),
                output::or_dash(&s.image),
                output::state(s.state),
                output::time(s.created_at.as_ref()),
                output::labels(&s.labels),
            ]
        })
        .collect();
    output::stdout(
        output::table(
            &["ID", "ISOLATION", "IMAGE", "STATE", "CREATED", "LABELS"],
            &rows,
        )
        .as_bytes(),
    )?;
    Ok(0)
}

/// Shows one sandbox.
pub async fn get(ctx: &Ctx, id: String) -> Result<u8> {
    let s = ctx.client().await?.get(id).await?;
    if ctx.json {
        output::json(&json::sandbox(&s))?;
        return Ok(0);
    }
    let limits = s.limits.unwrap_or_default();
    let rows = [
        ("ID", s.id.clone()),
        ("ISOLATION", output::isolation(s.isolation)),
        ("IMAGE", output::or_dash(&s.image)),
        ("STATE", output::state(s.state)),
        ("CREATED", output::time(s.created_at.as_ref())),
        ("EXPIRES", output::time(s.expires_at.as_ref())),
        ("WORKDIR", output::or_dash(&s.workdir)),
        (
            "USER",
            if s.user.is_empty() {
                "root".to_string()
            } else {
                s.user.clone()
            },
        ),
        ("PARENT_SNAPSHOT", output::or_dash(&s.parent_snapshot_id)),
        ("CPU", format!("{}m", limits.cpu_millicores)),
        ("MEMORY", output::size(limits.memory_bytes)),
        ("PIDS", limits.max_pids.to_string()),
        ("DISK", output::size(limits.disk_bytes)),
        ("EXEC_TIMEOUT", format!("{}ms", limits.exec_timeout_ms)),
        ("LABELS", output::labels(&s.labels)),
        (
            "NETWORK",
            match &s.network {
                Some(n) if !n.allow.is_empty() => {
                    format!("{} {}", json::network_mode_name(n.mode), n.allow.join(" "))
                }
                Some(n) => json::network_mode_name(n.mode).to_string(),
                None => "NONE".to_string(),
            },
        ),
    ];
    let mut rows = rows.to_vec();
    if let Some(u) = &s.usage {
        let unknown = || "-".to_string();
        rows.extend([
            (
                "CPU_USED",
                format!("{}ms user, {}ms system", u.cpu_user_ms, u.cpu_system_ms),
            ),
            (
                "MEMORY_USED",
                format!(
                    "{} (peak {})",
                    output::size(u.memory_bytes),
                    output::size(u.peak_memory_bytes)
                ),
            ),
            (
                "PIDS_USED",
                u.pids.map(|p| p.to_string()).unwrap_or_else(unknown),
            ),
            (
                "DISK_USED",
                u.disk_bytes.map(output::size).unwrap_or_else(unknown),
            ),
        ]);
    }
    output::stdout(output::fields(&rows).as_bytes())?;
    Ok(0)
}

/// Prints the sandbox's recent network events.
pub async fn network_log(ctx: &Ctx, id: String, limit: u32) -> Result<u8> {
    let events = ctx.client().await?.network_log(id, limit).await?;
    if ctx.json {
        output::json(&events.iter().map(json::network_event).collect())?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            vec![
                output::time(e.time.as_ref()),
                e.kind.clone(),
                if e.allowed { "allowed" } else { "denied" }.to_string(),
                output::or_dash(&e.name),
                output::or_dash(&e.addr),
                if e.port == 0 {
                    "-".to_string()
                } else {
                    e.port.to_string()
                },
                if e.allowed {
                    output::or_dash(&e.rule)
                } else {
                    output::ellipsize(&e.detail, 60)
                },
                format!("{}/{}", e.bytes_out, e.bytes_in),
                format!("{}ms", e.duration_ms),
            ]
        })
        .collect();
    output::stdout(
        output::table(
            &[
                "TIME", "KIND", "VERDICT", "NAME", "ADDR", "PORT", "RULE/WHY", "OUT/IN", "DURATION",
            ],
            &rows,
        )
        .as_bytes(),
    )?;
    Ok(0)
}

/// Sets the sandbox's TTL from now and prints when it now expires (`-` for never).
pub async fn set_ttl(ctx: &Ctx, id: String, secs: u32) -> Result<u8> {
    let s = ctx.client().await?.set_ttl(id, secs).await?;
    if ctx.json {
        output::json(&json::sandbox(&s))?;
        return Ok(0);
    }
    output::stdout(format!("{}\n", output::time(s.expires_at.as_ref())).as_bytes())?;
    Ok(0)
}

/// Pauses the sandbox and prints its state (PAUSED).
pub async fn pause(ctx: &Ctx, id: String) -> Result<u8> {
    let s = ctx.client().await?.pause(id).await?;
    print_state(ctx, &s)
}

/// Resumes the sandbox and prints its state (RUNNING) and when it now expires.
pub async fn resume(ctx: &Ctx, id: String, ttl: u32) -> Result<u8> {
    let s = ctx.client().await?.resume(id, ttl).await?;
    print_state(ctx, &s)
}

/// `ID STATE EXPIRES` for pause and resume (or the sandbox as JSON).
fn print_state(ctx: &Ctx, s: &Sandbox) -> Result<u8> {
    if ctx.json {
        output::json(&json::sandbox(s))?;
        return Ok(0);
    }
    let line = format!(
        "{} {} {}\n",
        s.id,
        output::state(s.state),
        output::time(s.expires_at.as_ref())
    );
    output::stdout(line.as_bytes())?;
    Ok(0)
}

/// Destroys every sandbox given, going on past failures; exits 1 if any failed.
pub async fn remove(ctx: &Ctx, ids: Vec<String>) -> Result<u8> {
    let client = ctx.client().await?;
    let mut report = Vec::new();
    let mut failed = false;
    for id in ids {
        match client.destroy(id.as_str()).await {
            Ok(()) => report.push(json!({ "sandbox_id": id, "destroyed": true })),
            Err(err) => {
                failed = true;
                if !ctx.json {
                    output::note(&format!("{id}: {err}"))?;
                }
                let error = json!({ "code": agent_client::code_name(err.code()), "message": err.to_string() });
                report.push(json!({ "sandbox_id": id, "destroyed": false, "error": error }));
            }
        }
    }
    if ctx.json {
        output::json(&serde_json::Value::Array(report))?;
    }
    Ok(u8::from(failed))
}
