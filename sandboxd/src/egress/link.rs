//! The host side of a sandbox's network: a veth pair per sandbox and one nftables table that
//! sends every TCP connection and DNS query from a sandbox to the daemon, and drops everything
//! else (no forwarding at all: the daemon's proxy is the only way out). Done with `ip` and `nft`
//! from Debian's iproute2 and nftables: the kernel's own tools, maintained, and what an operator
//! reads back with `nft list table inet sandboxd_sbxe`.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

/// The daemon's host-side names: its nftables table and its interfaces' prefix. One daemon per
/// prefix: another daemon with the same one would replace the table.
#[derive(Debug, Clone)]
pub struct Names {
    /// `inet` table: `sandboxd_<prefix>`.
    pub table: String,
    /// Host-side interfaces are this and the slot number.
    pub prefix: String,
}

impl Names {
    /// Names for `prefix`: 1-8 of `[a-z0-9]`, so that the interface names (prefix and a slot
    /// number) fit in 15 bytes.
    pub fn new(prefix: &str) -> Result<Names, String> {
        if prefix.is_empty()
            || prefix.len() > 8
            || !prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            || prefix.starts_with(|c: char| c.is_ascii_digit())
        {
            return Err(format!("network.interface_prefix {prefix:?}: 1-8 of a-z and 0-9, starting with a letter"));
        }
        Ok(Names { table: format!("sandboxd_{prefix}"), prefix: prefix.to_string() })
    }

    /// The host-side interface of slot `slot`.
    pub fn ifname(&self, slot: u32) -> String {
        format!("{}{slot}", self.prefix)
    }
}

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<(), String> {
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("running {program}: {e}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(|e| format!("writing to {program}: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("waiting for {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether `ip`, `nft` and `nsenter` are there to be run.
pub fn tools_present() -> Result<(), String> {
    for (tool, pkg) in [("ip", "iproute2"), ("nft", "nftables"), ("nsenter", "util-linux")] {
        Command::new(tool).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().map_err(|e| format!("{tool} ({pkg}) not runnable: {e}"))?;
    }
    Ok(())
}

/// How many flows the host's connection tracking may hold for one sandbox at a time (its TCP
/// connections to the proxy, open or half-open, and its DNS exchanges): a new one past this is
/// dropped before it is tracked, so one sandbox cannot fill the host's conntrack table (which
/// every container and host service shares). Closed TCP connections are not counted.
pub const MAX_TRACKED_FLOWS_PER_SANDBOX: u32 = 1024;

/// (Re)creates the table: TCP from sandbox interfaces redirected to `proxy_port`, UDP/53 to
/// `dns_port`, sources checked against the set of (interface, address) pairs so no sandbox
/// speaks with another's address, IPv6 dropped, nothing forwarded, nothing else delivered.
/// Everything but TCP and UDP/53 is dropped in the raw hook, before connection tracking sees
/// it; the flows a sandbox may have tracked at once are capped
/// ([`MAX_TRACKED_FLOWS_PER_SANDBOX`]).
pub fn install_table(names: &Names, proxy_port: u16, dns_port: u16) -> Result<(), String> {
    let (p, table) = (&names.prefix, &names.table);
    let max_flows = MAX_TRACKED_FLOWS_PER_SANDBOX;
    let rules = format!(
        "table inet {table}\ndelete table inet {table}\n\
table inet {table} {{
  set sources {{ type ifname . ipv4_addr; }}
  set flows {{ type ipv4_addr; size 65535; flags dynamic; }}
  chain prerouting_raw {{ type filter hook prerouting priority raw; policy accept;
    iifname \"{p}*\" meta nfproto != ipv4 drop
    iifname \"{p}*\" iifname . ip saddr != @sources drop
    iifname \"{p}*\" meta l4proto udp udp dport != 53 drop
    iifname \"{p}*\" meta l4proto != {{ tcp, udp }} drop
  }}
  chain prerouting_flows {{ type filter hook prerouting priority mangle; policy accept;
    iifname \"{p}*\" ct state new add @flows {{ ip saddr ct count over {max_flows} }} drop
  }}
  chain prerouting_nat {{ type nat hook prerouting priority dstnat; policy accept;
    iifname \"{p}*\" meta l4proto tcp redirect to :{proxy_port}
    iifname \"{p}*\" udp dport 53 redirect to :{dns_port}
  }}
  chain input_filter {{ type filter hook input priority filter - 10; policy accept;
    iifname \"{p}*\" tcp dport {proxy_port} ct status dnat accept
    iifname \"{p}*\" udp dport {dns_port} ct status dnat accept
    iifname \"{p}*\" drop
  }}
  chain forward_filter {{ type filter hook forward priority filter - 10; policy accept;
    iifname \"{p}*\" drop
    oifname \"{p}*\" drop
  }}
}}\n"
    );
    run("nft", &["-f", "-"], Some(&rules))
}

// The table is never removed, not even at shutdown: sandboxes may outlive the daemon (their
// links too, until their init dies), and without its forward rule a host that forwards (Docker
// turns that on) would route a sandbox's packets anywhere. The next start replaces it in one
// transaction, with an empty set of sources.

/// Gives the network namespace of process `pid` an `eth0` at `addr`/30 with a default route via
/// `gw`, the host end of a veth pair at `gw`/30.
pub fn attach(names: &Names, slot: u32, pid: i32, gw: Ipv4Addr, addr: Ipv4Addr) -> Result<(), String> {
    let ifname = names.ifname(slot);
    // A leftover of a sandbox whose init died without a detach (a daemon crash).
    let _ = run("ip", &["link", "del", &ifname], None);
    let pid_s = pid.to_string();
    run("ip", &["link", "add", &ifname, "type", "veth", "peer", "name", "eth0", "netns", &pid_s], None)?;
    let done = (|| {
        // No IPv6 on the host end: no link-local address for the sandbox to talk to.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"), "1");
        run("ip", &["addr", "add", &format!("{gw}/30"), "dev", &ifname], None)?;
        run("ip", &["link", "set", &ifname, "up"], None)?;
        let inside = format!("addr add {addr}/30 dev eth0\nlink set eth0 up\nroute add default via {gw}\n");
        run("nsenter", &[&format!("--net=/proc/{pid}/ns/net"), "ip", "-batch", "-"], Some(&inside))?;
        run("nft", &["add", "element", "inet", &names.table, "sources", &format!("{{ \"{ifname}\" . {addr} }}")], None)
    })();
    if done.is_err() {
        detach(names, slot, addr);
    }
    done
}

/// The MAC address of every TAP device's host end. Fixed, so that a guest resumed from a memory
/// snapshot (whose ARP cache names the gateway's MAC at the time) reaches its new link's gateway
/// at once; each TAP is a link of its own, so no two ends ever share a segment.
pub const TAP_HOST_MAC: &str = "02:73:62:78:00:01";
/// The guest's MAC address (the virtio-net device's), fixed for the same reason.
pub const TAP_GUEST_MAC: &str = "02:73:62:78:00:02";

/// `_IOW('T', 202, int)`: attach the descriptor to a TUN/TAP device, creating it.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// Creates slot `slot`'s TAP device (host end `gw`/30, the guest to be `addr`) and returns the
/// descriptor that holds it: not persistent, so it goes when QEMU (the other holder) and this
/// descriptor are closed. The sources set admits only `addr` from it.
pub fn attach_tap(names: &Names, slot: u32, gw: Ipv4Addr, addr: Ipv4Addr) -> Result<std::os::fd::OwnedFd, String> {
    use std::os::fd::AsRawFd;
    let ifname = names.ifname(slot);
    // A leftover of a VM whose QEMU has not quite gone yet, or of a daemon crash.
    let _ = run("ip", &["link", "del", &ifname], None);
    let tun = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun").map_err(|e| format!("opening /dev/net/tun: {e}"))?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(ifname.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI;
    // SAFETY: TUNSETIFF reads (and writes back the name into) the ifreq we pass; the fd is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut ifr) } < 0 {
        return Err(format!("creating TAP device {ifname}: {}", std::io::Error::last_os_error()));
    }
    let done = (|| {
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"), "1");
        run("ip", &["addr", "add", &format!("{gw}/30"), "dev", &ifname], None)?;
        run("ip", &["link", "set", &ifname, "address", TAP_HOST_MAC, "up"], None)?;
        run("nft", &["add", "element", "inet", &names.table, "sources", &format!("{{ \"{ifname}\" . {addr} }}")], None)
    })();
    if let Err(e) = done {
        detach(names, slot, addr);
        return Err(e);
    }
    Ok(tun.into())
}

/// Takes a slot's link away (the veth goes with the namespace too; this is for the set and
/// for a namespace that outlives its sandbox). Idempotent.
pub fn detach(names: &Names, slot: u32, addr: Ipv4Addr) {
    let ifname = names.ifname(slot);
    let _ = run("nft", &["delete", "element", "inet", &names.table, "sources", &format!("{{ \"{ifname}\" . {addr} }}")], None);
    let _ = run("ip", &["link", "del", &ifname], None);
}
