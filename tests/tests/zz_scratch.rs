use std::collections::HashMap;
use std::time::{Duration, Instant};
use agent_client::proto::{ExecRequest, ResourceLimits, CreateSandboxRequest};
use agent_client::exec_request;
use sandbox_tests::{mounts_under, process_sandbox, Daemon};

#[tokio::test(flavor = "multi_thread")]
async fn scratch_stop() {
    for bg in [false, true] {
        let mut d = Daemon::start().await.unwrap();
        let c = d.client().await.unwrap();
        let id = c.create(process_sandbox("minimal")).await.unwrap().id;
        if bg {
            let r = c.exec(exec_request(&id, ["sh", "-c", "sleep 300 & echo started"])).await.unwrap();
            println!("bg exec: {:?}", String::from_utf8_lossy(&r.stdout));
        }
        let sd = d.state_dir();
        let st = d.stop().unwrap();
        println!("bg={bg} status={st} mounts={:?}", mounts_under(&sd));
        println!("{}", d.log().lines().filter(|l| l.contains("WARN")).collect::<Vec<_>>().join("\n"));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn scratch_bomb() {
    let d = Daemon::start().await.unwrap();
    let c = d.client().await.unwrap();
    let id = c.create(CreateSandboxRequest { limits: Some(ResourceLimits { max_pids: 64, ..Default::default() }), ..process_sandbox("minimal") }).await.unwrap().id;
    let t0 = Instant::now();
    let r = c.exec(ExecRequest { timeout_ms: 5000, ..exec_request(&id, ["sh", "-c", "f(){ f|f& }; f; sleep 1"]) }).await.unwrap();
    println!("bomb: {:?} status={} code={} err={} in {:?}", String::from_utf8_lossy(&r.stderr).chars().take(300).collect::<String>(), r.status, r.exit_code, r.error, t0.elapsed());
    for i in 0..20 {
        let r = c.exec(exec_request(&id, ["sh", "-c", "ps | wc -l"])).await.unwrap();
        println!("{i}: status={} code={} out={:?} err={:?} error={}", r.status, r.exit_code, String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr).chars().take(100).collect::<String>(), r.error);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _ = HashMap::<u8,u8>::new();
}
