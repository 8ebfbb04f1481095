//! The container tier's exec channel (issue #28): an exec started by the container's own exec
//! helper must be confined exactly like one `docker exec` starts in the same container —
//! same user and groups, capability sets, no-new-privileges, seccomp, AppArmor label, OOM score,
//! rlimits, namespaces and root — and sit in a cgroup below the one `docker exec` joins (its
//! own, for per-exec usage and kills). Compared process by process, as root and as a user.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::process::Command;

use agent_client::exec_request;
use agent_client::proto::{ExecStatus, Isolation};
use sandbox_tests::{describe, within, Harness};

/// What a shell prints about its own confinement (everything but its cgroup, compared apart).
const CONFINEMENT: &str = r#"
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/$$/status
echo "apparmor: $(cat /proc/$$/attr/current 2>&1)"
echo "oom_score_adj: $(cat /proc/$$/oom_score_adj)"
echo "rlimits: $(ulimit -a | tr '\n' ' ')"
for n in cgroup ipc mnt net pid uts user; do echo "ns $n: $(readlink /proc/$$/ns/$n)"; done
echo "root inode: $(ls -di / | cut -d' ' -f1)"
echo "umask: $(umask)"
"#;

/// `docker exec` of `sh -c script` in `container` (as `user` when given): its stdout.
fn docker_exec(container: &str, user: Option<&str>, script: &str) -> String {
    let mut cmd = Command::new("docker");
    cmd.arg("exec");
    if let Some(u) = user {
        cmd.args(["-u", u]);
    }
    let out = cmd.args([container, "sh", "-c", script]).output().expect("running the docker CLI (CI has it)");
    assert!(out.status.success(), "docker exec failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `hierarchy-id:controllers` → path, from /proc/<pid>/cgroup.
fn cgroups(text: &str) -> Vec<(String, String)> {
    text.lines().filter_map(|l| l.rsplit_once(':').map(|(k, p)| (k.to_string(), p.to_string()))).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exec_through_the_helper_is_confined_exactly_like_docker_exec() {
    let h = Harness::start().await;
    let sandbox = within(120, h.client.create(sandbox_tests::sandbox_request(Isolation::Container, "minimal"))).await.expect("CreateSandbox");
    let container = format!("sandboxd-{}", sandbox.id);
    for user in [None, Some("nobody")] {
        let mut request = exec_request(&sandbox.id, ["sh", "-c", CONFINEMENT]);
        request.user = user.unwrap_or_default().to_string();
        let ours = h.exec(request).await;
        assert_eq!(ours.status(), ExecStatus::Exited, "{}", describe(&ours));
        let ours = String::from_utf8_lossy(&ours.stdout).to_string();
        let theirs = docker_exec(&container, user, CONFINEMENT);
        assert!(ours.contains("CapBnd:") && ours.contains("Seccomp:") && ours.contains("ns pid:"), "the probe printed its confinement: {ours}");
        assert_eq!(ours, theirs, "user {user:?}: sandboxd's exec (left) and docker exec (right) differ");
    }
    // The cgroup: in every hierarchy the one `docker exec` puts its process in or below it, and
    // below it (the exec's own) wherever usage and kills are counted (on v1 a hierarchy of
    // `cpu` or `pids` alone keeps the container's: its quota and pid limit).
    let mut request = exec_request(&sandbox.id, ["cat", "/proc/self/cgroup"]);
    request.user = String::new();
    let ours = h.exec(request).await;
    let ours = cgroups(&String::from_utf8_lossy(&ours.stdout));
    let theirs = cgroups(&docker_exec(&container, None, "cat /proc/self/cgroup"));
    assert!(!theirs.is_empty());
    assert_eq!(ours.len(), theirs.len(), "{ours:?} vs {theirs:?}");
    for ((ok, op), (tk, tp)) in ours.iter().zip(&theirs) {
        assert_eq!(ok, tk, "{ours:?} vs {theirs:?}");
        let below = op.starts_with(&format!("{}/", tp.trim_end_matches('/')));
        assert!(below || op == tp, "hierarchy {ok}: ours {op} is outside docker exec's {tp}");
        // cgroup v2 has one hierarchy; on v1 the empty unified one (`0::`) holds no controller.
        let counted = ours.len() == 1 || ["memory", "freezer", "cpuacct"].iter().any(|c| ok.split([':', ',']).any(|x| x == *c));
        if counted {
            assert!(below, "hierarchy {ok}: ours {op} is not the exec's own cgroup below docker exec's {tp}");
        }
    }
}

/// The ExecResult of an exec started through the helper keeps every field the Docker path gave:
/// environment layered over the container's, HOME from /etc/passwd for a user, stdin, exit
/// codes and signals, and start failures with the sentences of every tier.
#[tokio::test(flavor = "multi_thread")]
async fn helper_execs_keep_env_home_stdin_and_failures() {
    let h = Harness::start().await;
    let id = within(120, h.client.create(sandbox_tests::sandbox_request(Isolation::Container, "minimal"))).await.expect("CreateSandbox").id;
    let container = format!("sandboxd-{id}");
    // The environment a plain `docker exec` gets, plus the exec's own variables.
    let mut r = exec_request(&id, ["sh", "-c", "env | sort"]);
    r.env.insert("ONLY_HERE".into(), "x=y".into());
    let ours = h.exec(r).await;
    let ours = String::from_utf8_lossy(&ours.stdout).to_string();
    assert!(ours.lines().any(|l| l == "ONLY_HERE=x=y"), "{ours}");
    for line in docker_exec(&container, None, "env | sort").lines() {
        let name = line.split('=').next().unwrap_or_default();
        assert!(ours.lines().any(|l| l.split('=').next() == Some(name)), "{name} of docker exec's env is missing: {ours}");
    }
    let mut r = exec_request(&id, ["sh", "-c", "echo $HOME; id -u"]);
    r.user = "nobody".into();
    let r = h.exec(r).await;
    assert_eq!(String::from_utf8_lossy(&r.stdout), "/nonexistent\n65534\n", "{}", describe(&r));
    let mut r = exec_request(&id, ["cat"]);
    r.stdin = b"through the pipe".to_vec();
    let r = h.exec(r).await;
    assert_eq!(r.stdout, b"through the pipe", "{}", describe(&r));
    let r = h.exec(exec_request(&id, ["sh", "-c", "exit 201"])).await;
    assert_eq!((r.status(), r.exit_code), (ExecStatus::Exited, 201), "exit codes above 128 stay exits: {}", describe(&r));
    let r = h.exec(exec_request(&id, ["sh", "-c", "kill -TERM $$"])).await;
    assert_eq!((r.status(), r.signal), (ExecStatus::Signaled, 15), "{}", describe(&r));
    let r = h.exec(exec_request(&id, ["no-such-program"])).await;
    assert_eq!((r.status(), r.exit_code), (ExecStatus::SpawnFailed, 127), "{}", describe(&r));
    assert!(r.stderr.is_empty() && r.error.contains("no-such-program"), "{}", describe(&r));
    let mut r = exec_request(&id, ["pwd"]);
    r.workdir = "/no/such/dir".into();
    let r = h.exec(r).await;
    assert_eq!(r.status(), ExecStatus::SpawnFailed, "{}", describe(&r));
    assert!(r.error.contains("/no/such/dir"), "{}", describe(&r));
}

/// `[container] warm_pool`: the first create of a shape fills a pool in the background; the
/// next create of that shape takes a started container and makes it the sandbox's own — its
/// hostname (the UTS name, /etc/hostname, /etc/hosts), its workdir, its limits — and execs,
/// files and snapshots work as in any container sandbox. After a daemon restart it is
/// re-adopted under its own hostname, and the pool's idle containers are gone from Docker.
#[tokio::test(flavor = "multi_thread")]
async fn a_container_from_the_warm_pool_becomes_the_sandboxs_own() {
    let mut h = Harness::start_with_config("[container]\nwarm_pool = 1\n").await;
    let limits = agent_client::proto::ResourceLimits { memory_bytes: 192 << 20, ..Default::default() };
    let request = |workdir: &str| agent_client::proto::CreateSandboxRequest {
        limits: Some(limits),
        workdir: workdir.to_string(),
        ..sandbox_tests::sandbox_request(Isolation::Container, "minimal")
    };
    let first = within(120, h.client.create(request("/workspace"))).await.expect("the first create").id;
    assert!(
        sandbox_tests::eventually(120, || std::future::ready(h.daemon.log().contains("container warm pool: a container is ready"))).await,
        "the pool never filled: {}",
        h.daemon.log()
    );
    let id = within(120, h.client.create(request("/srv/app"))).await.expect("a create from the pool").id;
    assert!(h.daemon.log().lines().any(|l| l.contains("taken from the warm pool") && l.contains(&format!("sandbox={id}"))), "{}", h.daemon.log());
    let seen = h.sh_ok(&id, "hostname; cat /etc/hostname; grep -c \"$(hostname)\" /etc/hosts; pwd; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max").await;
    assert_eq!(seen, format!("{id}\n{id}\n1\n/srv/app\n{}\n", 192u64 << 20));
    within(30, h.client.write_file(&id, "/srv/app/f", "pooled", 0o644)).await.expect("WriteFile");
    let snap = within(120, h.client.snapshot(&id, "s")).await.expect("snapshot").snapshot_id;
    h.sh_ok(&id, "rm /srv/app/f").await;
    within(300, h.client.rollback(&id, &snap)).await.expect("rollback");
    assert_eq!(h.sh_ok(&id, "cat /srv/app/f; hostname").await, format!("pooled{id}\n"));

    // Restarted: the sandbox is re-adopted under its own hostname; nothing else of ours is left.
    within(120, h.daemon.restart()).await.expect("restart");
    h.client = h.daemon.client().await.expect("client");
    assert!(
        sandbox_tests::eventually(120, || async { h.client.get(&id).await.is_ok_and(|s| s.state == agent_client::proto::SandboxState::Running as i32) }).await,
        "re-adopted"
    );
    assert_eq!(h.sh_ok(&id, "hostname; cat /etc/hostname").await, format!("{id}\n{id}\n"));
    for sb in [&first, &id] {
        within(120, h.client.destroy(sb)).await.expect("destroy");
    }
}
