//! What a sandbox may reach: its network mode and allow list, parsed and matched. Pure logic,
//! no sockets: the DNS server and the proxy ask these questions.

use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Most entries in one allow list.
pub const MAX_ALLOW_RULES: usize = 64;

/// How much network a sandbox gets, in increasing order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// Loopback only: no interface but `lo`.
    #[default]
    None,
    /// Egress only to the listed names and CIDRs, on their ports.
    Allowlist,
    /// Everything but the host, link-local/metadata addresses, other sandboxes and the
    /// operator's denied ranges.
    Open,
}

impl NetworkMode {
    /// The API's spelling.
    pub fn name(self) -> &'static str {
        match self {
            NetworkMode::None => "NONE",
            NetworkMode::Allowlist => "ALLOWLIST",
            NetworkMode::Open => "OPEN",
        }
    }
}

/// A sandbox's network: its mode and, for ALLOWLIST, what it may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NetworkPolicy {
    pub mode: NetworkMode,
    pub allow: Vec<AllowRule>,
}

impl NetworkPolicy {
    /// A policy from the request's mode and entries, checked: entries only with ALLOWLIST.
    pub fn new(mode: NetworkMode, allow: &[String]) -> Result<Self, String> {
        if mode != NetworkMode::Allowlist && !allow.is_empty() {
            return Err(format!("allow entries need mode ALLOWLIST (mode is {})", mode.name()));
        }
        if allow.len() > MAX_ALLOW_RULES {
            return Err(format!("{} entries, at most {MAX_ALLOW_RULES}", allow.len()));
        }
        let allow = allow.iter().map(|a| a.parse::<AllowRule>()).collect::<Result<Vec<_>, _>>()?;
        Ok(NetworkPolicy { mode, allow })
    }

    /// The first rule allowing `name` on `port`, if any (ALLOWLIST; OPEN allows every name).
    pub fn name_rule(&self, name: &str, port: Option<u16>) -> Option<&AllowRule> {
        self.allow.iter().find(|r| matches!(&r.dest, Dest::Name(p) if p.matches(name)) && port.is_none_or(|p| r.port == p))
    }

    /// The first CIDR rule allowing `addr:port`, if any.
    pub fn cidr_rule(&self, addr: Ipv4Addr, port: u16) -> Option<&AllowRule> {
        self.allow.iter().find(|r| matches!(&r.dest, Dest::Cidr(c) if c.contains(addr)) && r.port == port)
    }
}

/// One allow-list entry: `pypi.org:443`, `*.github.com:443`, `10.1.0.0/16:5432`, `192.0.2.7:80`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AllowRule {
    pub dest: Dest,
    pub port: u16,
}

/// Where an entry points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    Name(NamePattern),
    Cidr(Cidr),
}

/// A DNS name, or `*.` and a suffix (any name below it, not the suffix itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamePattern {
    pub wildcard: bool,
    /// Lowercase, no trailing dot.
    pub name: String,
}

impl NamePattern {
    /// Whether `name` (any case, a trailing dot allowed) is covered.
    pub fn matches(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.wildcard {
            name.len() > self.name.len() + 1 && name.ends_with(&self.name) && name.as_bytes()[name.len() - self.name.len() - 1] == b'.'
        } else {
            name == self.name
        }
    }
}

/// An IPv4 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub net: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    /// Whether `addr` is inside.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        let mask = if self.prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(self.prefix)) };
        u32::from(addr) & mask == u32::from(self.net) & mask
    }

    /// Whether every address of `other` is inside.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.prefix <= other.prefix && self.contains(other.net)
    }

    /// The `i`-th address of the network.
    pub fn nth(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.net).wrapping_add(i))
    }

    /// How many addresses it holds.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (net, prefix) = s.split_once('/').unwrap_or((s, "32"));
        let net: Ipv4Addr = net.parse().map_err(|_| format!("{s:?} is not an IPv4 address or CIDR"))?;
        let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32).ok_or_else(|| format!("{s:?}: the prefix must be 0-32"))?;
        let c = Cidr { net, prefix };
        // Canonical: host bits zero, so what is printed back is what matches.
        Ok(Cidr { net: Ipv4Addr::from(u32::from(net) & if prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(prefix)) }), ..c })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// Whether `name` is a DNS name we accept in a rule or a query: 1-253 bytes, labels of 1-63 of
/// `[a-z0-9-_]`, not starting or ending with `-`.
pub fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty() && l.len() <= 63 && !l.starts_with('-') && !l.ends_with('-') && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl std::str::FromStr for AllowRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (dest, port) = s.rsplit_once(':').ok_or_else(|| format!("{s:?}: expected DEST:PORT (pypi.org:443, *.github.com:443, 10.1.0.0/16:5432)"))?;
        let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| format!("{s:?}: the port must be 1-65535"))?;
        let dest = if dest.starts_with(|c: char| c.is_ascii_digit()) && dest.bytes().all(|b| b.is_ascii_digit() || b == b'.' || b == b'/') {
            Dest::Cidr(dest.parse()?)
        } else {
            let lower = dest.to_ascii_lowercase();
            let (wildcard, name) = match lower.strip_prefix("*.") {
                Some(rest) => (true, rest.to_string()),
                None => (false, lower),
            };
            let name = name.trim_end_matches('.').to_string();
            if !is_dns_name(&name) {
                return Err(format!("{s:?}: {dest:?} is not a DNS name, *.name, IPv4 address or CIDR"));
            }
            Dest::Name(NamePattern { wildcard, name })
        };
        Ok(AllowRule { dest, port })
    }
}

impl fmt::Display for AllowRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dest {
            Dest::Name(p) if p.wildcard => write!(f, "*.{}:{}", p.name, self.port),
            Dest::Name(p) => write!(f, "{}:{}", p.name, self.port),
            Dest::Cidr(c) => write!(f, "{c}:{}", self.port),
        }
    }
}

impl TryFrom<String> for AllowRule {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<AllowRule> for String {
    fn from(r: AllowRule) -> String {
        r.to_string()
    }
}

/// Why an address is never reachable from a sandbox, whatever its mode says; None if it may be.
/// `host` holds the host's own addresses, `sandboxes` the sandboxes' link network, `deny` the
/// operator's ranges.
pub fn always_denied(addr: Ipv4Addr, host: &[Ipv4Addr], sandboxes: &Cidr, deny: &[Cidr]) -> Option<String> {
    if addr.is_loopback() {
        return Some("loopback".into());
    }
    if addr.is_link_local() {
        return Some("link-local (metadata)".into());
    }
    if addr.is_unspecified() || addr.is_broadcast() || addr.is_multicast() || u32::from(addr) >> 24 == 0 || u32::from(addr) >> 28 >= 0xe {
        return Some("not a unicast address".into());
    }
    if sandboxes.contains(addr) {
        return Some("the sandboxes' network".into());
    }
    if host.contains(&addr) {
        return Some("the host".into());
    }
    deny.iter().find(|c| c.contains(addr)).map(|c| format!("denied range {c}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(s: &str) -> AllowRule {
        s.parse().expect("rule")
    }

    #[test]
    fn a_range_covers_itself_and_what_lies_inside_it_only() {
        let c = |s: &str| s.parse::<Cidr>().expect("cidr");
        assert!(c("10.0.0.0/8").covers(&c("10.0.0.0/8")));
        assert!(c("10.0.0.0/8").covers(&c("10.1.0.0/16")));
        assert!(c("10.0.0.0/8").covers(&c("10.255.255.255/32")));
        assert!(!c("10.1.0.0/16").covers(&c("10.0.0.0/8")), "larger");
        assert!(!c("10.0.0.0/8").covers(&c("11.0.0.0/16")), "outside");
        assert!(c("0.0.0.0/0").covers(&c("192.0.2.7/32")));
    }

    #[test]
    fn rules_parse_and_print_back() {
        for s in ["pypi.org:443", "*.github.com:443", "10.1.0.0/16:5432", "192.0.2.7/32:80"] {
            assert_eq!(rule(s).to_string(), s);
        }
        assert_eq!(rule("192.0.2.7:80").to_string(), "192.0.2.7/32:80");
        assert_eq!(rule("PyPI.org.:443").to_string(), "pypi.org:443");
        assert_eq!(rule("10.1.2.3/16:1").to_string(), "10.1.0.0/16:1");
        for bad in ["pypi.org", "pypi.org:0", "pypi.org:70000", "bad name:1", "*.:1", "-x.org:1", "10.0.0.0/33:1", ":80", "a..b:1"] {
            assert!(bad.parse::<AllowRule>().is_err(), "{bad} accepted");
        }
        let long = format!("{}.org:1", "a".repeat(64));
        assert!(long.parse::<AllowRule>().is_err());
    }

    #[test]
    fn names_match_exactly_or_below_a_wildcard() {
        let p = NetworkPolicy::new(NetworkMode::Allowlist, &["pypi.org:443".into(), "*.github.com:443".into()]).expect("policy");
        assert!(p.name_rule("pypi.org", Some(443)).is_some());
        assert!(p.name_rule("PYPI.ORG.", None).is_some());
        assert!(p.name_rule("pypi.org", Some(80)).is_none());
        assert!(p.name_rule("files.pypi.org", None).is_none());
        assert!(p.name_rule("api.github.com", Some(443)).is_some());
        assert!(p.name_rule("a.b.github.com", Some(443)).is_some());
        assert!(p.name_rule("github.com", Some(443)).is_none());
        assert!(p.name_rule("evilgithub.com", Some(443)).is_none());
    }

    #[test]
    fn entries_need_allowlist_mode() {
        assert!(NetworkPolicy::new(NetworkMode::Open, &["pypi.org:443".into()]).is_err());
        assert!(NetworkPolicy::new(NetworkMode::None, &["pypi.org:443".into()]).is_err());
        assert!(NetworkPolicy::new(NetworkMode::Allowlist, &[]).is_ok());
    }

    #[test]
    fn host_metadata_neighbours_and_denied_ranges_are_never_reachable() {
        let sandboxes: Cidr = "100.96.0.0/16".parse().expect("cidr");
        let deny: Vec<Cidr> = vec!["10.0.0.0/8".parse().expect("cidr")];
        let host = [Ipv4Addr::new(198, 18, 0, 1)];
        for a in ["127.0.0.1", "169.254.169.254", "100.96.0.6", "10.1.2.3", "198.18.0.1", "0.0.0.0", "255.255.255.255", "224.0.0.1"] {
            assert!(always_denied(a.parse().expect("addr"), &host, &sandboxes, &deny).is_some(), "{a}");
        }
        assert!(always_denied(Ipv4Addr::new(198, 18, 0, 2), &host, &sandboxes, &deny).is_none());
        let p = NetworkPolicy::new(NetworkMode::Allowlist, &["198.18.0.0/24:7000".into()]).expect("policy");
        assert!(p.cidr_rule(Ipv4Addr::new(198, 18, 0, 9), 7000).is_some());
        assert!(p.cidr_rule(Ipv4Addr::new(198, 18, 1, 9), 7000).is_none());
        assert!(p.cidr_rule(Ipv4Addr::new(198, 18, 0, 9), 7001).is_none());
    }
}
