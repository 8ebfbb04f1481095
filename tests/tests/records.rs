//! End to end: exec records stay bounded. Output bodies live in files under the state dir, not in
//! `state.db`; a per-sandbox byte budget drops the oldest bodies; ListExecs returns metadata in
//! pages; GetExec still returns a recent exec's whole output; destroy removes the files.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::Path;

use agent_client::{exec_request, proto, Client};
use sandbox_tests::{process_sandbox, Daemon};
use tonic::Code;

const MIB: usize = 1 << 20;

/// 8 MiB of recorded output per sandbox: two and a half of the execs below.
const CONFIG: &str = "[exec]\nmax_output_bytes_ceiling = 16777216\nmax_output_storage_bytes_per_sandbox = 8388608\n";

/// Bytes of the files under `dir`, recursively (0 when it does not exist).
fn du(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => du(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// Every record of a sandbox, page by page, checking each page against the bounds.
async fn list_all(c: &Client, sb: &str, page_size: u32, include_output: bool) -> Vec<proto::ExecResult> {
    let mut request = proto::ListExecsRequest { sandbox_id: sb.into(), page_size, include_output, ..Default::default() };
    let mut out = Vec::new();
    for _ in 0..100 {
        let page = c.list_execs_page(request.clone()).await.expect("ListExecs page");
        assert!(!page.execs.is_empty(), "a page after a token is never empty here");
        if page_size > 0 {
            assert!(page.execs.len() <= page_size as usize, "page of {} records for page_size {page_size}", page.execs.len());
        }
        let bytes: usize = page.execs.iter().map(|e| e.stdout.len() + e.stderr.len()).sum();
        assert!(page.execs.len() == 1 || bytes <= 4 * MIB, "a page of {} records carries {bytes} bytes of output", page.execs.len());
        out.extend(page.execs);
        if page.next_page_token.is_empty() {
            return out;
        }
        request.page_token = page.next_page_token;
    }
    panic!("ListExecs never ended its listing");
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_output_is_bounded_on_the_host_and_listed_in_pages() {
    let daemon = Daemon::start_with_config(CONFIG).await.expect("daemon");
    let c = daemon.client().await.expect("client");
    let sb = c.create(process_sandbox("minimal")).await.expect("create").id;

    // An exec over its cap keeps its whole stdout in a spill file inside the sandbox.
    let script = format!("yes spill | head -c {MIB}");
    let spilled = c.exec(proto::ExecRequest { max_output_bytes: 64 << 10, ..exec_request(&sb, ["sh", "-c", &script]) }).await.expect("exec");
    assert!(spilled.stdout_truncated && !spilled.stdout_spill_path.is_empty(), "{spilled:?}");
    let spill = c.read_file(&sb, &spilled.stdout_spill_path, 0, 1).await.expect("the spill file is there");
    assert_eq!(spill.size, MIB as u64);

    // Six execs of 3 MiB recorded output each (2 MiB stdout, 1 MiB stderr), well within a
    // 16 MiB per-stream cap: 18 MiB against an 8 MiB budget.
    let mut execs = Vec::new();
    for i in 0..6 {
        let script = format!("yes out{i} | head -c {}; yes err{i} | head -c {} >&2", 2 * MIB, MIB);
        let request = proto::ExecRequest { max_output_bytes: 16 << 20, ..exec_request(&sb, ["sh", "-c", &script]) };
        let r = c.exec(request).await.expect("exec");
        assert_eq!((r.status, r.exit_code), (proto::ExecStatus::Exited as i32, 0), "{}", String::from_utf8_lossy(&r.stderr[..r.stderr.len().min(200)]));
        assert_eq!((r.stdout.len(), r.stderr.len()), (2 * MIB, MIB), "the exec's own answer carries its whole output");
        assert!(!r.stdout_truncated && !r.output_discarded);
        execs.push(r);
    }
    let ids: Vec<&str> = std::iter::once(&spilled).chain(&execs).map(|e| e.exec_id.as_str()).collect();

    // The database holds metadata only; the bodies on disk stay within the budget.
    let state = daemon.state_dir();
    let db: u64 = ["state.db", "state.db-wal", "state.db-shm"].iter().filter_map(|f| std::fs::metadata(state.join(f)).ok()).map(|m| m.len()).sum();
    assert!(db < MIB as u64, "18 MiB of output grew state.db (+WAL) to {db} bytes");
    let outputs = state.join("outputs").join(&sb);
    let stored = du(&outputs);
    assert!(stored > 0 && stored <= 8 * MIB as u64, "{stored} bytes of output stored for an 8 MiB budget");

    // ListExecs without options: one page of every record, metadata only.
    let page = c.list_execs_page(proto::ListExecsRequest { sandbox_id: sb.clone(), ..Default::default() }).await.expect("ListExecs");
    assert_eq!(page.execs.iter().map(|e| e.exec_id.as_str()).collect::<Vec<_>>(), ids, "oldest first, all of them");
    assert!(page.next_page_token.is_empty(), "seven records fit on one page");
    for e in &page.execs {
        assert!(e.stdout.is_empty() && e.stderr.is_empty(), "ListExecs returned a body by default: {}", e.exec_id);
    }
    for e in &page.execs[1..] {
        assert_eq!(e.stdout_total_bytes, 2 * MIB as u64, "the metadata still says what was written");
    }

    // Paging: every record exactly once, in order, however small the pages.
    let paged = list_all(&c, &sb, 2, false).await;
    assert_eq!(paged.iter().map(|e| e.exec_id.as_str()).collect::<Vec<_>>(), ids);
    // With output: pages stop near 4 MiB, bodies match what the execs returned.
    let with_output = list_all(&c, &sb, 0, true).await;
    assert_eq!(with_output.iter().map(|e| e.exec_id.as_str()).collect::<Vec<_>>(), ids);
    for (listed, original) in with_output[1..].iter().zip(&execs) {
        if !listed.output_discarded {
            assert_eq!(listed.stdout, original.stdout, "{}", listed.exec_id);
            assert_eq!(listed.stderr, original.stderr, "{}", listed.exec_id);
        }
    }
    // `limit` keeps the newest, across pages too.
    let newest = c.list_execs_page(proto::ListExecsRequest { sandbox_id: sb.clone(), limit: 3, page_size: 2, ..Default::default() }).await.expect("ListExecs");
    let rest = c
        .list_execs_page(proto::ListExecsRequest { sandbox_id: sb.clone(), page_token: newest.next_page_token.clone(), ..Default::default() })
        .await
        .expect("ListExecs page 2");
    assert_eq!(newest.execs.iter().chain(&rest.execs).map(|e| e.exec_id.as_str()).collect::<Vec<_>>(), ids[4..]);
    assert!(rest.next_page_token.is_empty());
    let bad = proto::ListExecsRequest { sandbox_id: sb.clone(), page_token: "not-a-token".into(), ..Default::default() };
    assert_eq!(c.list_execs_page(bad).await.expect_err("bad token").code(), Code::InvalidArgument);

    // GetExec: the newest exec's whole output; the oldest big one's was dropped for the budget.
    let last = c.get_exec(ids[6], false).await.expect("GetExec newest");
    assert!(!last.output_discarded);
    assert_eq!((last.stdout.as_slice(), last.stderr.as_slice()), (execs[5].stdout.as_slice(), execs[5].stderr.as_slice()));
    let first = c.get_exec(ids[1], false).await.expect("GetExec oldest: its record stays");
    assert!(first.output_discarded, "the oldest exec's output should be reported discarded");
    assert!(first.stdout.is_empty() && first.stderr.is_empty());
    assert_eq!((first.status, first.stdout_total_bytes), (proto::ExecStatus::Exited as i32, 2 * MIB as u64));
    let discarded: Vec<&str> = with_output.iter().filter(|e| e.output_discarded).map(|e| e.exec_id.as_str()).collect();
    assert_eq!(discarded, ids[..5], "18 MiB against 8 MiB: the oldest lose their output, the two newest keep it");

    // The trimmed record's spill file inside the sandbox goes too (in the background).
    let trimmed = c.get_exec(&spilled.exec_id, false).await.expect("GetExec spilled");
    assert!(trimmed.output_discarded && trimmed.stdout_spill_path.is_empty(), "{trimmed:?}");
    let mut spill_gone = false;
    for _ in 0..100 {
        match c.read_file(&sb, &spilled.stdout_spill_path, 0, 1).await {
            Err(e) if e.code() == Code::NotFound => {
                spill_gone = true;
                break;
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
    assert!(spill_gone, "{} is still in the sandbox after its record was trimmed", spilled.stdout_spill_path);

    // Destroy removes the records and the output directory.
    c.destroy(&sb).await.expect("destroy");
    assert!(!outputs.exists(), "{} outlived its sandbox", outputs.display());
    assert_eq!(c.get_exec(ids[6], false).await.expect_err("records go with the sandbox").code(), Code::NotFound);
}
