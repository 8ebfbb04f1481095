//! `sbx snapshot`, `snapshots`, `rollback` and `rmsnap`.

use anyhow::Result;
use serde_json::json;

use crate::{json, output, Ctx};

/// Snapshots a sandbox and prints the snapshot id.
pub async fn create(
    ctx: &Ctx,
    sandbox_id: String,
    name: Option<String>,
    no_memory: bool,
) -> Result<u8> {
    let info = ctx
        .client()
        .await?
        .snapshot_with(
            sandbox_id,
            name.unwrap_or_default(),
            no_memory.then_some(false),
        )
        .await?;
    if ctx.json {
        output::json(&json::snapshot(&info))?;
    } else {
        output::line(&info.snapshot_id)?;
    }
    Ok(0)
}

/// Lists a sandbox's snapshots.
pub async fn list(ctx: &Ctx, sandbox_id: String) -> Result<u8> {
    let snapshots = ctx.client().await?.list_snapshots(sandbox_id).await?;
    if ctx.json {
        output::json(&snapshots.iter().map(json::snapshot).collect())?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = snapshots
        .iter()
        .map(|s| {
            vec![
                s.snapshot_id.clone(),
                output::or_dash(&s.name),
                s.sandbox_id.clone(),
                output::size(s.size_bytes),
                output::time(s.created_at.as_ref()),
                output::or_dash(&s.parent_snapshot_id),
            ]
        })
        .collect();
    output::stdout(
        output::table(
            &[
                "SNAPSHOT_ID",
                "NAME",
                "SANDBOX",
                "SIZE",
                "CREATED",
                "PARENT",
            ],
            &rows,
        )
        .as_bytes(),
    )?;
    Ok(0)
}

/// Rolls a sandbox back to a snapshot.
pub async fn rollback(ctx: &Ctx, sandbox_id: String, snapshot_id: String) -> Result<u8> {
    let sandbox = ctx
        .client()
        .await?
        .rollback(sandbox_id, snapshot_id)
        .await?;
    if ctx.json {
        output::json(&json::sandbox(&sandbox))?;
    }
    Ok(0)
}

/// Deletes a snapshot.
pub async fn delete(ctx: &Ctx, snapshot_id: String) -> Result<u8> {
    ctx.client()
        .await?
        .delete_snapshot(snapshot_id.as_str())
        .await?;
    if ctx.json {
        output::json(&json!({ "snapshot_id": snapshot_id, "deleted": true }))?;
    }
    Ok(0)
}
