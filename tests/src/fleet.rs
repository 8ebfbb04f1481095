//! A fleet of three daemons (issue #27), as `tests/tests/fleet.rs` and the `fleet_bench` binary
//! both build it: three network namespaces joined by a bridge in a fourth (the hub), a veth from
//! the host (where the client runs) to that bridge, and dnsmasq on the hub answering one name
//! with the three nodes' addresses, as cluster DNS answers a headless Service ([`Net`]). Each
//! node ([`start_node`]) listens on TCP at its address, serving TLS with a certificate of a CA
//! the test makes (peers check one another against it), with two tenants' tokens, and finds its
//! peers through that name; [`start_alone`] starts the same node without `[fleet]`.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use agent_client::Client;
use anyhow::{ensure, Context, Result};
use sha2::{Digest, Sha256};

use crate::{text, within, Daemon};

/// The nodes' names, in the order of their addresses (node A first).
pub const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
/// The name dnsmasq answers with the three nodes' addresses.
pub const DNS_NAME: &str = "peers.fleet.test";
/// The port every node serves its API (and the fleet's calls) on.
pub const PORT: u16 = 7070;
/// Each node's page (`--web`), on its fleet address: off loopback, allowed because of the tokens.
pub const WEB_PORT: u16 = 8090;
/// Tenant `team-a`'s token.
pub const TOKEN_A: &str = "tenant-a-token-0123456789";
/// Tenant `team-b`'s token.
pub const TOKEN_B: &str = "tenant-b-token-0123456789";
/// The token the nodes show one another.
pub const FLEET_TOKEN: &str = "fleet-token-abcdefghijklmnop";

/// Runs a host command; an error with its output if it fails.
fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {args:?}"))?;
    ensure!(out.status.success(), "{args:?}: {}{}", text(&out.stdout), text(&out.stderr));
    Ok(())
}

/// The network: a hub namespace with a bridge, one namespace per node on it, a veth from the
/// host (where the test runs) to the bridge, and dnsmasq on the hub. Removed on drop.
pub struct Net {
    prefix: String,
    hub: String,
    nodes: Vec<String>,
    host_if: String,
    dns: Option<Child>,
    dir: tempfile::TempDir,
}

impl Net {
    /// Node `i`'s address (10.231.x.2 for node A).
    pub fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.prefix, i + 2)
    }

    /// Node `i`'s network namespace (`ip netns` name).
    pub fn netns(&self, i: usize) -> &str {
        &self.nodes[i]
    }

    /// The temp dir holding dnsmasq's hosts file and the fleet token.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Makes the namespaces, the bridge, the links and starts dnsmasq; what a killed run left
    /// behind under the same names is removed first.
    pub fn setup() -> Result<Net> {
        for tool in ["ip", "nsenter", "dnsmasq"] {
            let found = Command::new("sh").arg("-c").arg(format!("command -v {tool}")).stdout(Stdio::null()).status().map(|s| s.success()).unwrap_or(false);
            ensure!(found, "the fleet needs `{tool}` (images/deps.sh installs it: dnsmasq-base, iproute2, util-linux)");
        }
        let n = std::process::id() % 200 + 20;
        let prefix = format!("10.231.{n}");
        let tag = format!("{n}");
        let hub = format!("sbxf{tag}hub");
        let nodes: Vec<String> = (0..3).map(|i| format!("sbxf{tag}n{i}")).collect();
        let host_if = format!("sbxf{tag}h");
        let dir = tempfile::tempdir().context("tempdir")?;
        let mut net = Net { prefix: prefix.clone(), hub: hub.clone(), nodes: nodes.clone(), host_if: host_if.clone(), dns: None, dir };
        // Leftovers of a run that was killed: gone first.
        net.teardown();
        run(&["ip", "netns", "add", &hub])?;
        run(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        run(&["ip", "-n", &hub, "addr", "add", &format!("{prefix}.1/24"), "dev", "br0"])?;
        run(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        run(&["ip", "-n", &hub, "link", "set", "lo", "up"])?;
        for (i, ns) in nodes.iter().enumerate() {
            run(&["ip", "netns", "add", ns])?;
            let port = format!("p{i}");
            run(&["ip", "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
            run(&["ip", "-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            run(&["ip", "-n", ns, "addr", "add", &format!("{}/24", net.addr(i)), "dev", "eth0"])?;
            run(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        run(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", "up0", "netns", &hub])?;
        run(&["ip", "-n", &hub, "link", "set", "up0", "master", "br0", "up"])?;
        run(&["ip", "addr", "add", &format!("{prefix}.254/24"), "dev", &host_if])?;
        run(&["ip", "link", "set", &host_if, "up"])?;
        // The headless Service's name with one A record per node, as cluster DNS gives it.
        let hosts = net.dir().join("hosts");
        let lines: String = (0..3).map(|i| format!("{} {DNS_NAME}\n", net.addr(i))).collect();
        std::fs::write(&hosts, lines).context("writing dnsmasq's hosts file")?;
        let dns = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{hub}"))
            .args(["--", "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces"])
            .arg(format!("--listen-address={prefix}.1"))
            .arg(format!("--addn-hosts={}", hosts.display()))
            .arg(format!("--pid-file={}", net.dir().join("dnsmasq.pid").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dnsmasq")?;
        net.dns = Some(dns);
        net.make_certificates()?;
        Ok(net)
    }

    /// A CA and one certificate for every node (SANs: the headless name and the three
    /// addresses), with the host's openssl: the nodes serve TLS and check one another with it.
    fn make_certificates(&self) -> Result<()> {
        let path = |name: &str| self.dir().join(name).display().to_string();
        let ips: String = (0..3).map(|i| format!(",IP:{}", self.addr(i))).collect();
        let ext = self.dir().join("san.ext");
        std::fs::write(&ext, format!("subjectAltName=DNS:{DNS_NAME}{ips}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")).context("san.ext")?;
        #[rustfmt::skip]
        let steps: [Vec<String>; 3] = [
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sandboxd fleet test CA", "-keyout", &path("ca.key"), "-out", &path("ca.pem")].map(String::from).to_vec(),
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={DNS_NAME}"), "-keyout", &path("node.key"), "-out", &path("node.csr")].map(String::from).to_vec(),
            ["openssl", "x509", "-req", "-in", &path("node.csr"), "-CA", &path("ca.pem"), "-CAkey", &path("ca.key"), "-CAcreateserial", "-days", "2", "-extfile", &ext.display().to_string(), "-out", &path("node.pem")].map(String::from).to_vec(),
        ];
        for args in steps {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&args)?;
        }
        Ok(())
    }

    /// The CA (PEM) the nodes' certificates are signed by.
    pub fn ca_pem(&self) -> Result<Vec<u8>> {
        std::fs::read(self.ca_path()).context("reading the fleet's CA")
    }

    /// The file of [`Net::ca_pem`].
    pub fn ca_path(&self) -> std::path::PathBuf {
        self.dir().join("ca.pem")
    }

    /// `[tls]`: the nodes' certificate and key.
    fn tls_table(&self) -> String {
        format!("[tls]\ncert = \"{}\"\nkey = \"{}\"\n", self.dir().join("node.pem").display(), self.dir().join("node.key").display())
    }

    fn teardown(&mut self) {
        if let Some(mut d) = self.dns.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).stderr(Stdio::null()).status();
        for ns in self.nodes.iter().chain([&self.hub]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// `[policy]` with `max_sandboxes` (and `more_policy`'s lines) and `[auth]` with the two
/// tenants' tokens: a node's configuration without `[fleet]`.
fn policy_and_auth(max_sandboxes: usize, more_policy: &str) -> String {
    let hash = |t: &str| Sha256::digest(t.as_bytes()).iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!(
        r#"
[policy]
max_sandboxes = {max_sandboxes}
{more_policy}[[auth.tokens]]
tenant = "team-a"
sha256 = "{a}"
[[auth.tokens]]
tenant = "team-b"
sha256 = "{b}"
"#,
        a = hash(TOKEN_A),
        b = hash(TOKEN_B),
    )
}

/// Node `i`'s configuration: at most `max_sandboxes` sandboxes, the tenants' tokens, and
/// `[fleet]` with its peers from dnsmasq and the fleet token read from `{dir}/fleet-token`.
pub fn config(net: &Net, i: usize, max_sandboxes: usize) -> String {
    config_with(net, i, max_sandboxes, "")
}

/// [`config`] with `more_policy`'s lines in its `[policy]` table.
pub fn config_with(net: &Net, i: usize, max_sandboxes: usize, more_policy: &str) -> String {
    format!(
        r#"{policy}{tls}[fleet]
node_name = "{node}"
peers_dns = "{DNS_NAME}"
port = {PORT}
dns_server = "{prefix}.1:53"
refresh_ms = 1000
connect_timeout_ms = 1000
token_file = "{{dir}}/fleet-token"
tls_ca_file = "{ca}"
"#,
        policy = policy_and_auth(max_sandboxes, more_policy),
        tls = net.tls_table(),
        ca = net.dir().join("ca.pem").display(),
        node = NODES[i],
        prefix = net.prefix,
    )
}

/// Starts node `i` of the fleet in its namespace, on its address (`--listen` TCP, `--web`).
pub async fn start_node(net: &Net, i: usize, max_sandboxes: usize) -> Result<Daemon> {
    start_node_with(net, i, max_sandboxes, "").await
}

/// [`start_node`] with `more_policy`'s lines in the node's `[policy]` table (e.g. the tiers it
/// offers: `allowed = ["process"]`).
pub async fn start_node_with(net: &Net, i: usize, max_sandboxes: usize, more_policy: &str) -> Result<Daemon> {
    // The fleet token, as a Kubernetes Secret would mount it.
    let token = net.dir().join("fleet-token");
    std::fs::write(&token, FLEET_TOKEN).context("writing the fleet token")?;
    let toml = config_with(net, i, max_sandboxes, more_policy).replace("{dir}/fleet-token", &token.display().to_string());
    start_in(net, i, &toml).await.with_context(|| format!("starting fleet node {}", NODES[i]))
}

/// Starts node `i` as [`start_node`] does but alone: the same namespace, address, listeners and
/// tokens, no `[fleet]`; one tenant may hold all `max_sandboxes` (past the default per-tenant cap).
pub async fn start_alone(net: &Net, i: usize, max_sandboxes: usize) -> Result<Daemon> {
    let toml = policy_and_auth(max_sandboxes, &format!("max_sandboxes_per_tenant = {max_sandboxes}\n")) + &net.tls_table();
    start_in(net, i, &toml).await.with_context(|| format!("starting {} alone", NODES[i]))
}

async fn start_in(net: &Net, i: usize, toml: &str) -> Result<Daemon> {
    let listen = format!("tcp://{}:{PORT}", net.addr(i));
    let web = format!("{}:{WEB_PORT}", net.addr(i));
    within(60, Daemon::start_in_netns(net.netns(i), toml, &["--listen", &listen, "--web", &web])).await
}

/// A client of node `i` over TCP (TLS, checked against the fleet's CA) with a tenant's `token`.
pub async fn client_of(net: &Net, i: usize, token: &str) -> Result<Client> {
    let client =
        Client::connect_with_ca(&format!("https://{}:{PORT}", net.addr(i)), &net.ca_pem()?).await.with_context(|| format!("connecting to {}", NODES[i]))?;
    client.with_token(token).context("the tenant's token")
}
