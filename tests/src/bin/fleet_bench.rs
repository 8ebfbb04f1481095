//! `fleet_bench`: what a three-node fleet (issue #27) costs and gives, measured on the fleet the
//! fleet test builds ([`sandbox_tests::fleet`]: three daemons in three network namespaces on a
//! bridge, peers from dnsmasq, tenant tokens), with one in-process client per connection (no
//! `sbx` process start):
//!
//! 1. `Exec` of `true` in a sandbox on node B through node A (one forwarding hop), against the
//!    same sandbox through B directly and a sandbox on A through A.
//! 2. Creates per second through node A of the fleet (A fills first, then places creates on the
//!    peers by their room), against node A alone (no `[fleet]`), with a few concurrent clients.
//! 3. A fan-out `ListSandboxes` through A with the fleet holding the sandboxes of 2., and one
//!    that fans out and matches nothing.
//!
//! `make bench` runs it and writes the `## Fleet` section of BENCHMARKS.md (`--out FILE`).
//! Nothing here asserts a timing.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agent_client::proto::{CreateSandboxRequest, ResourceLimits};
use agent_client::{exec_request, Client};
use anyhow::{ensure, Context, Result};
use clap::Parser;
use sandbox_tests::fleet::{client_of, start_alone, start_node, Net, NODES, TOKEN_A};
use sandbox_tests::{process_sandbox, replace_section, require_environment, sandboxd_bin};

/// The bench binary's statistics (nearest-rank percentiles), shared rather than copied.
#[allow(dead_code)] // this binary uses part of them
#[path = "bench/stats.rs"]
mod stats;

use stats::{ms, signed_ms, summarize, Summary};

#[derive(Parser)]
#[command(about = "Forwarded exec, creates per second and fan-out list of a three-node fleet")]
struct Args {
    /// Timed `Exec` calls per path (after 20 warm-up calls each).
    #[arg(long, default_value_t = 300)]
    exec_rounds: usize,
    /// Sandboxes per node: the creates (3 × this, through one address) and what the list lists.
    #[arg(long, default_value_t = 1000)]
    per_node: usize,
    /// Clients creating at once (each its own connection).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Timed `ListSandboxes` calls per row (after 3 warm-up calls).
    #[arg(long, default_value_t = 50)]
    list_rounds: usize,
    /// Markdown file whose `## Fleet` section is replaced with the results.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Awaits `fut` for at most `secs`; an error naming `what` when it takes longer.
async fn bounded<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(Duration::from_secs(secs), fut).await.with_context(|| format!("{what} did not return within {secs} s"))
}

/// A `minimal` process sandbox with small limits (disk, memory, pids), so that one node's pool
/// and admission admit thousands (the default 512 MiB and 256 pids stop one node near 1,400 and
/// 1,900 sandboxes on this machine).
fn small_sandbox() -> CreateSandboxRequest {
    let limits = ResourceLimits { disk_bytes: 64 << 20, memory_bytes: 64 << 20, max_pids: 32, ..Default::default() };
    CreateSandboxRequest { limits: Some(limits), ..process_sandbox("minimal") }
}

/// `count` clients of node `i` with tenant A's token, each its own connection.
async fn clients_of(net: &Net, i: usize, count: usize) -> Result<Vec<Client>> {
    let mut out = Vec::new();
    for _ in 0..count {
        out.push(client_of(net, i, TOKEN_A).await?);
    }
    Ok(out)
}

/// One timed create: how long it took and the node that holds the sandbox.
struct Created {
    id: String,
    node: String,
    took: Duration,
}

/// What `n` creates through `clients` at once gave: each create, and the wall time of all.
struct Creates {
    each: Vec<Created>,
    wall: Duration,
}

impl Creates {
    fn per_second(&self) -> f64 {
        self.each.len() as f64 / self.wall.as_secs_f64()
    }
}

/// `n` creates, each client making one at a time until `n` are made.
async fn create_many(clients: &[Client], n: usize) -> Result<Creates> {
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let workers = clients.iter().map(|c| {
        let next = &next;
        async move {
            let mut made = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let t = Instant::now();
                let sb = bounded(180, "CreateSandbox", c.create(small_sandbox()))
                    .await?
                    .with_context(|| format!("a create of {n} through {} clients", clients.len()))?;
                made.push(Created { id: sb.id, node: sb.node, took: t.elapsed() });
            }
            Ok::<_, anyhow::Error>(made)
        }
    });
    let each = futures::future::try_join_all(workers).await?.into_iter().flatten().collect();
    Ok(Creates { each, wall: start.elapsed() })
}

/// Destroys `ids` through `clients` at once; the wall time.
async fn destroy_all(clients: &[Client], ids: Vec<String>) -> Result<Duration> {
    let queue = std::sync::Mutex::new(ids);
    let start = Instant::now();
    let workers = clients.iter().map(|c| {
        let queue = &queue;
        async move {
            loop {
                let Some(id) = queue.lock().map_err(|_| anyhow::anyhow!("a destroy worker panicked"))?.pop() else { return Ok::<_, anyhow::Error>(()) };
                bounded(180, "DestroySandbox", c.destroy(&id)).await?.with_context(|| format!("destroying {id}"))?;
            }
        }
    });
    futures::future::try_join_all(workers).await?;
    Ok(start.elapsed())
}

/// Creates one sandbox through `client` and checks it landed on node `node`.
async fn one_on(client: &Client, node: &str) -> Result<String> {
    let sb = bounded(180, "CreateSandbox", client.create(small_sandbox())).await?.context("CreateSandbox")?;
    ensure!(sb.node == node, "a create through {node} with room landed on {} ({})", sb.node, sb.id);
    Ok(sb.id)
}

/// One `Exec` of `true`: its wall time.
async fn exec_true(client: &Client, id: &str) -> Result<Duration> {
    let t = Instant::now();
    let r = bounded(60, "Exec", client.exec(exec_request(id, ["true"]))).await?.with_context(|| format!("Exec true in {id}"))?;
    let took = t.elapsed();
    ensure!(r.exit_code == 0, "`true` in {id} exited {}: {}", r.exit_code, String::from_utf8_lossy(&r.stderr));
    Ok(took)
}

/// One `ListSandboxes` through `client` with `selector`: its wall time and what it listed.
async fn list_once(client: &Client, selector: &HashMap<String, String>) -> Result<(Duration, usize)> {
    let t = Instant::now();
    let r = bounded(60, "ListSandboxes", client.list_fleet(selector.clone())).await?.context("ListSandboxes")?;
    let took = t.elapsed();
    ensure!(r.unreachable_nodes.is_empty(), "nodes did not answer the list: {:?}", r.unreachable_nodes);
    Ok((took, r.sandboxes.len()))
}

/// `rounds` timed lists (after 3 untimed), each expected to list `expect` sandboxes.
async fn lists(client: &Client, selector: HashMap<String, String>, rounds: usize, expect: usize) -> Result<Vec<Duration>> {
    let mut samples = Vec::new();
    for round in 0..rounds + 3 {
        let (took, listed) = list_once(client, &selector).await?;
        ensure!(listed == expect, "the list through node A has {listed} sandboxes, not {expect}");
        if round >= 3 {
            samples.push(took);
        }
    }
    Ok(samples)
}

/// A table row: what, n, p50, p99, and the last column.
fn row(what: &str, s: Summary, last: &str) -> String {
    format!("| {what} | {} | {} ms | {} ms | {last} |", s.n, ms(s.p50), ms(s.p99))
}

fn summary(samples: &[Duration], what: &str) -> Result<Summary> {
    summarize(samples).with_context(|| format!("no samples of {what}"))
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg has them.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_else(|e| format!("unknown ({e})"))
}

/// Row 1: exec through A of a sandbox on B, the same through B, one on A through A.
async fn exec_rows(net: &Net, rounds: usize) -> Result<Vec<String>> {
    let a = client_of(net, 0, TOKEN_A).await?;
    let b = client_of(net, 1, TOKEN_A).await?;
    let on_a = one_on(&a, NODES[0]).await?;
    let on_b = one_on(&b, NODES[1]).await?;
    let paths = [(&a, &on_b), (&b, &on_b), (&a, &on_a)];
    let mut samples: [Vec<Duration>; 3] = Default::default();
    for round in 0..rounds + 20 {
        // Each round runs the three paths in turn, starting with another each round, so that
        // drift in the machine's load falls on all three alike.
        for k in 0..3 {
            let p = (round + k) % 3;
            let took = exec_true(paths[p].0, paths[p].1).await?;
            if round >= 20 {
                samples[p].push(took);
            }
        }
    }
    a.destroy(&on_a).await.context("destroying the sandbox on A")?;
    a.destroy(&on_b).await.context("destroying the sandbox on B")?;
    let hop = summary(&samples[0], "exec through A")?;
    let direct = summary(&samples[1], "exec through B")?;
    let local = summary(&samples[2], "exec on A")?;
    Ok(vec![
        row("`Exec` `true`, sandbox on A, through A", local, "—"),
        row("`Exec` `true`, sandbox on B, through B directly", direct, "—"),
        row(
            "`Exec` `true`, sandbox on B, through A (one hop)",
            hop,
            &format!("hop adds {} ms to p50 (vs through B), {} ms (vs on A)", signed_ms(hop.p50 - direct.p50), signed_ms(hop.p50 - local.p50)),
        ),
    ])
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    require_environment()?;
    let bin = sandboxd_bin()?;
    let began = Instant::now();
    let load_before = loadavg();
    let n = 3 * args.per_node;
    // Room for `clients` more on each node than it is given, so that creates racing for a
    // node's last seat never find the whole fleet full.
    let max_per_node = args.per_node + args.clients;
    let net = Net::setup()?;
    let mut rows = Vec::new();

    // Node A alone: the same namespace, address, tokens and clients, no `[fleet]`.
    let alone = {
        eprintln!("fleet_bench: {n} creates on node A alone");
        let daemon = start_alone(&net, 0, n + args.clients).await?;
        let clients = clients_of(&net, 0, args.clients).await?;
        let created = create_many(&clients, n).await?;
        eprintln!("fleet_bench: destroying them");
        destroy_all(&clients, created.each.iter().map(|c| c.id.clone()).collect()).await?;
        // Stopped (gracefully) before node A of the fleet takes its address.
        drop(daemon);
        created
    };

    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start_node(&net, i, max_per_node).await?);
    }
    eprintln!("fleet_bench: exec, {} rounds per path", args.exec_rounds);
    rows.extend(exec_rows(&net, args.exec_rounds).await?);

    eprintln!("fleet_bench: {n} creates through node A of the fleet");
    let clients = clients_of(&net, 0, args.clients).await?;
    let fleet = create_many(&clients, n).await?;
    let took = |f: &dyn Fn(&Created) -> bool| fleet.each.iter().filter(|c| f(c)).map(|c| c.took).collect::<Vec<_>>();
    let kept = took(&|c| c.node == NODES[0]);
    let placed = took(&|c| c.node != NODES[0]);
    let held: Vec<String> = NODES.iter().map(|node| format!("{node} {}", fleet.each.iter().filter(|c| c.node == *node).count())).collect();
    rows.push(row(
        &format!("`CreateSandbox`, node A alone ({n} through its address, {} clients)", args.clients),
        summary(&alone.each.iter().map(|c| c.took).collect::<Vec<_>>(), "creates alone")?,
        &format!("**{:.1} creates/s**", alone.per_second()),
    ));
    rows.push(row(
        &format!("`CreateSandbox`, 3-node fleet through A ({n}, {} clients)", args.clients),
        summary(&fleet.each.iter().map(|c| c.took).collect::<Vec<_>>(), "creates in the fleet")?,
        &format!("**{:.1} creates/s**; held: {}", fleet.per_second(), held.join(", ")),
    ));
    rows.push(row("… of which kept on A", summary(&kept, "creates kept on A")?, "—"));
    rows.push(row("… of which placed on B or C by A", summary(&placed, "creates placed on a peer")?, "—"));

    eprintln!("fleet_bench: {} lists through node A over {n} sandboxes", args.list_rounds);
    let a = &clients[0];
    let full = summary(&lists(a, HashMap::new(), args.list_rounds, n).await?, "lists")?;
    let none = HashMap::from([("none".to_string(), "x".to_string())]);
    let empty = summary(&lists(a, none, args.list_rounds, 0).await?, "empty lists")?;
    rows.push(row(&format!("`ListSandboxes` through A, {n} sandboxes on 3 nodes"), full, &format!("{n} listed")));
    rows.push(row("`ListSandboxes` through A, fans out, matches none", empty, "0 listed"));

    eprintln!("fleet_bench: destroying them");
    let destroyed = destroy_all(&clients, fleet.each.iter().map(|c| c.id.clone()).collect()).await?;
    drop(nodes);
    drop(net);

    let section = format!(
        "## Fleet\n\n\
         `fleet_bench`: a three-node fleet as `tests/tests/fleet.rs` builds it (three daemons in three network namespaces on \
         one bridge, peers from dnsmasq answering one name with their three addresses, tenant tokens over TCP with TLS between the client and the nodes and between the nodes), all on this \
         one machine, so the three nodes share its {cpus} CPUs: a fleet adds no CPU here, it only adds the work of routing. \
         The client is in-process (`agent_client::Client`, one connection per client, reused; no `sbx` process start), on the \
         host, reaching the nodes over a veth to the bridge. sandboxd: `{bin}`. Process tier, image `minimal`, 64 MiB of disk, 64 MiB of memory and 32 pids each (so that one node admits thousands).\n\n\
         - *Exec*: {exec} calls per path after 20 warm-up calls, the three paths in turn each round.\n\
         - *Creates*: {n} creates by {clients} clients at once (each makes one at a time), then destroyed; creates/s is {n} \
           over the wall time of all. *Node A alone*: the same node (namespace, address, tokens) without `[fleet]`. In the \
           fleet every node takes at most {max_per_node} (`policy.max_sandboxes`: {per_node} plus one per client, so creates \
           racing for a node's last seat never find the whole fleet full); A fills first, then places each create on the peer \
           with the most room by the peers' room as last asked (at most `fleet.placement_cache_ms` old, counting what A placed since), then the peer's create. Destroying the fleet's {n} \
           through A (most of them forwarded) took {destroyed:.1} s.\n\
         - *List*: {lists} calls after 3 warm-up calls, with the fleet holding the {n} sandboxes of the creates row \
           ({size}). *Matches none*: the same fan-out with a label selector no sandbox has.\n\
         - Nothing else on the machine is stopped (builds and tests of others may load it). Load average (1, 5, 15 min) \
           before → after: {load_before} → {load_after}. The run took {secs:.0} s.\n\n\
         | measurement | n | p50 | p99 | |\n|---|---:|---:|---:|---|\n{rows}\n",
        cpus = std::thread::available_parallelism().map_or(1, |n| n.get()),
        bin = bin.display(),
        exec = args.exec_rounds,
        clients = args.clients,
        per_node = args.per_node,
        lists = args.list_rounds,
        size = if args.per_node >= 1000 {
            format!("{} per node, as the issue asks", args.per_node)
        } else {
            format!("{} per node where the issue asks for 1,000: `--per-node 1000` for the full size", args.per_node)
        },
        destroyed = destroyed.as_secs_f64(),
        load_after = loadavg(),
        secs = began.elapsed().as_secs_f64(),
        rows = rows.join("\n"),
    );
    println!("{section}");
    if let Some(out) = &args.out {
        replace_section(out, "## Fleet", &section)?;
    }
    Ok(())
}
