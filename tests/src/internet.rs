//! The egress suites' "internet" (issue #24): a network namespace holding DNS, HTTP and raw TCP
//! servers (`tests/egress/internet.py`) at 198.18.x.2 (the benchmarking range, never a real
//! address), reached from the host over a veth, and a daemon whose upstream resolver is that
//! namespace's DNS server. The DNS server logs every query it gets, so a test sees what left.
//! `tests/tests/egress.rs` and the `egress_bench` binary both build one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::{eventually, Harness};

const INTERNET_PY: &str = include_str!("../egress/internet.py");

/// The test's internet: a network namespace with the servers of `internet.py`, its host side
/// at 198.18.`net`.1 and the servers at 198.18.`net`.2 (DNS on 53, HTTP on 8080, a TCP echo
/// server on 7000, HTTPS on 8443 with a certificate for `pypi.test` and `evil.test` signed by a
/// CA of its own: [`Internet::ca_pem`]). Dropping it removes the namespace, the link and the daemon's nftables table.
pub struct Internet {
    ns: String,
    host_if: String,
    server: Child,
    log: PathBuf,
    dir: tempfile::TempDir,
    net: u8,
}

/// Makes a CA and a server certificate for `pypi.test` and `evil.test` signed by it in `dir`
/// (`ca.pem`, `server.pem`, `server.key`) with the host's openssl.
fn make_certificates(dir: &std::path::Path) {
    let path = |name: &str| dir.join(name).display().to_string();
    let ext = dir.join("san.ext");
    std::fs::write(
        &ext,
        "subjectAltName=DNS:pypi.test,DNS:evil.test\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .expect("san.ext");
    #[rustfmt::skip]
    let steps: [Vec<String>; 3] = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=sandboxd egress test CA", "-keyout", &path("ca.key"), "-out", &path("ca.pem")].map(String::from).to_vec(),
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pypi.test", "-keyout", &path("server.key"), "-out", &path("server.csr")].map(String::from).to_vec(),
        ["x509", "-req", "-in", &path("server.csr"), "-CA", &path("ca.pem"), "-CAkey", &path("ca.key"), "-CAcreateserial", "-days", "2", "-extfile", &ext.display().to_string(), "-out", &path("server.pem")].map(String::from).to_vec(),
    ];
    for args in steps {
        let out = Command::new("openssl").args(&args).output().expect("running openssl (needed for the HTTPS server)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

fn run(cmd: &[&str]) {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Internet {
    /// Builds it; `n` (0-7) tells apart the internets of one process (the egress tests use 0-6,
    /// `egress_bench` 7). Panics when it cannot, saying what failed.
    pub async fn start(n: u8) -> Internet {
        crate::require_environment().expect("environment");
        assert!(n < 8);
        let pid = std::process::id();
        let net = 20 + ((pid % 29) as u8) * 8 + n;
        let (ns, host_if) = (format!("sbxtest-inet-{pid}-{n}"), format!("inet{}{n}", pid % 100_000));
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        run(&["ip", "netns", "add", &ns]);
        run(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
        run(&["ip", "addr", "add", &format!("198.18.{net}.1/24"), "dev", &host_if]);
        run(&["ip", "link", "set", &host_if, "up"]);
        run(&["ip", "-n", &ns, "addr", "add", &format!("198.18.{net}.2/24"), "dev", "eth0"]);
        run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        let dir = tempfile::tempdir().expect("tempdir");
        let (script, log) = (dir.path().join("internet.py"), dir.path().join("internet.log"));
        std::fs::write(&script, INTERNET_PY).expect("writing internet.py");
        make_certificates(dir.path());
        let tls = format!("--tls={},{}", dir.path().join("server.pem").display(), dir.path().join("server.key").display());
        let records = [
            format!("pypi.test=198.18.{net}.2"),
            format!("evil.test=198.18.{net}.2"),
            format!("host.test=198.18.{net}.1"),
            "meta.test=169.254.169.254".to_string(),
            "local.test=127.0.0.1".to_string(),
        ];
        let server = Command::new("ip")
            .args(["netns", "exec", &ns, "python3"])
            .arg(&script)
            .args(&records)
            .arg(&tls)
            .stdout(std::fs::File::create(&log).expect("log file"))
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting internet.py (python3 on the host)");
        let internet = Internet { ns, host_if, server, log, dir, net };
        assert!(eventually(30, || async { internet.queries().contains("ready") }).await, "the test internet did not start: {}", internet.queries());
        internet
    }

    /// The CA certificate (PEM) that signed the HTTPS server's certificate.
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.dir.path().join("ca.pem")).expect("ca.pem")
    }

    /// Everything its DNS server was asked.
    pub fn queries(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The servers' address (198.18.`net`.2).
    pub fn addr(&self) -> String {
        format!("198.18.{}.2", self.net)
    }

    /// The interface prefix of this internet's daemon (its nftables table is `sandboxd_<prefix>`).
    pub fn prefix(&self) -> String {
        format!("e{:04}{}x", std::process::id() % 10_000, self.net % 8)
    }

    /// The host's end of the link (198.18.`net`.1).
    pub fn host_addr(&self) -> String {
        format!("198.18.{}.1", self.net)
    }

    /// A daemon whose upstream resolver is this internet's, with sandbox links of its own.
    pub async fn daemon(&self, extra: &[&str]) -> Harness {
        self.daemon_with("", extra).await
    }

    /// The same, with more lines of the `[network]` table.
    pub async fn daemon_with(&self, network: &str, extra: &[&str]) -> Harness {
        let config = format!(
            "[network]\nsubnet = \"100.98.{net}.0/24\"\ninterface_prefix = \"{prefix}\"\nupstream_dns = \"{addr}:53\"\n{network}",
            net = self.net,
            prefix = self.prefix(),
            addr = self.addr(),
        );
        Harness::start_with(&config, extra).await
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        // The daemon (dropped before this) leaves its table on purpose; the owner removes it.
        let _ = Command::new("nft").args(["delete", "table", "inet", &format!("sandboxd_{}", self.prefix())]).output();
    }
}
