//! Isolation policy: which tier a request gets, which limits apply, how many sandboxes and execs
//! may exist — decided per request from its labels, as ops teams write it in `sandboxd.toml`.
//!
//! ```toml
//! [policy]
//! default_isolation = "process"
//! allowed = ["process", "container", "microvm"]
//! max_sandboxes = 500                    # default 4096
//! max_sandboxes_per_tenant = 50           # default 2048
//! max_concurrent_execs = 256
//! max_running_execs_per_sandbox = 64      # these four have defaults (below); 0 is refused
//! max_background_execs_per_sandbox = 32
//! max_running_execs_per_tenant = 1024
//! max_background_execs_per_tenant = 256
//!
//! [[policy.rules]]
//! name = "untrusted"
//! match_labels = { trust = "untrusted" }
//! min_isolation = "microvm"
//! upgrade = true            # false: a weaker request is refused (PERMISSION_DENIED naming the rule)
//! limits_max = { memory_bytes = 1073741824 }
//! ```
//!
//! A tier the host cannot run is never swapped for a weaker one: the upgraded request fails with
//! FAILED_PRECONDITION instead.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::model::{Isolation, Limits};
use crate::netpolicy::{AllowRule, Cidr, Dest, NetworkMode, NetworkPolicy};

/// Limits a rule overrides; unset fields keep what applies already.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PartialLimits {
    pub cpu_millicores: Option<u32>,
    pub memory_bytes: Option<u64>,
    pub max_pids: Option<u32>,
    pub disk_bytes: Option<u64>,
    pub exec_timeout_ms: Option<u64>,
    pub shm_bytes: Option<u64>,
}

impl PartialLimits {
    /// `base` with these values laid over it.
    pub fn over(&self, base: Limits) -> Limits {
        Limits {
            cpu_millicores: self.cpu_millicores.unwrap_or(base.cpu_millicores),
            memory_bytes: self.memory_bytes.unwrap_or(base.memory_bytes),
            max_pids: self.max_pids.unwrap_or(base.max_pids),
            disk_bytes: self.disk_bytes.unwrap_or(base.disk_bytes),
            exec_timeout_ms: self.exec_timeout_ms.unwrap_or(base.exec_timeout_ms),
            shm_bytes: self.shm_bytes.unwrap_or(base.shm_bytes),
        }
    }
}

fn min_limits(a: Limits, b: Limits) -> Limits {
    Limits {
        cpu_millicores: a.cpu_millicores.min(b.cpu_millicores),
        memory_bytes: a.memory_bytes.min(b.memory_bytes),
        max_pids: a.max_pids.min(b.max_pids),
        disk_bytes: a.disk_bytes.min(b.disk_bytes),
        exec_timeout_ms: a.exec_timeout_ms.min(b.exec_timeout_ms),
        // A default of 0 is "half of the memory limit", not the smallest value: it stays, and
        // the ceiling cuts it when the sandbox's limits are resolved.
        shm_bytes: if a.shm_bytes == 0 { 0 } else { a.shm_bytes.min(b.shm_bytes) },
    }
}

/// Names and values of each limit, for validation messages.
fn fields(l: &Limits) -> [(&'static str, u64); 6] {
    [
        ("cpu_millicores", l.cpu_millicores.into()),
        ("memory_bytes", l.memory_bytes),
        ("max_pids", l.max_pids.into()),
        ("disk_bytes", l.disk_bytes),
        ("exec_timeout_ms", l.exec_timeout_ms),
        ("shm_bytes", l.shm_bytes),
    ]
}

/// Whether 0 is a valid default of the limit `name`: `shm_bytes` 0 means half of the memory
/// limit.
fn zero_default_allowed(name: &str) -> bool {
    name == "shm_bytes"
}

/// One rule: requests whose labels include all of `match_labels` get its minimum isolation and
/// limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub name: String,
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    pub min_isolation: Option<Isolation>,
    /// Upgrade a weaker request to `min_isolation` (true) or refuse it (false).
    #[serde(default)]
    pub upgrade: bool,
    #[serde(default)]
    pub limits_default: PartialLimits,
    #[serde(default)]
    pub limits_max: PartialLimits,
    /// The most network a matching sandbox may have (NONE < ALLOWLIST < OPEN); a request over
    /// it is refused naming the rule. Implied `allowlist` by `network_allow`.
    #[serde(default)]
    pub max_network: Option<NetworkMode>,
    /// With `max_network = "allowlist"`: the only entries a matching sandbox may list, and the
    /// list one gets when it asks for no network of its own (the operator's "CI tasks reach the
    /// package mirror and the git host").
    #[serde(default)]
    pub network_allow: Vec<AllowRule>,
}

impl Rule {
    /// The rule's network ceiling, if it sets one.
    fn network_ceiling(&self) -> Option<NetworkMode> {
        self.max_network.or(if self.network_allow.is_empty() { None } else { Some(NetworkMode::Allowlist) })
    }

    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

fn default_isolation() -> Isolation {
    Isolation::Process
}

fn all_tiers() -> Vec<Isolation> {
    Isolation::ALL.to_vec()
}

/// Caps on the execs that run at once, each with the config key that names it in messages.
/// Every running exec holds daemon resources (two pipe descriptors on the process tier, an
/// output buffer, a task), so one sandbox or tenant must not be able to take them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecCaps {
    /// `policy.max_running_execs_per_sandbox`: foreground and background.
    pub running_per_sandbox: usize,
    /// `policy.max_background_execs_per_sandbox`.
    pub background_per_sandbox: usize,
    /// `policy.max_running_execs_per_tenant`, over all its sandboxes.
    pub running_per_tenant: usize,
    /// `policy.max_background_execs_per_tenant`.
    pub background_per_tenant: usize,
}

impl ExecCaps {
    /// Built-in caps. A tenant's 1024 running execs hold about 2048 descriptors, well inside
    /// the open-file limit the daemon raises itself to at start (logged); 500 short execs at
    /// once from one tenant is a tested load.
    pub const DEFAULTS: ExecCaps = ExecCaps { running_per_sandbox: 64, background_per_sandbox: 32, running_per_tenant: 1024, background_per_tenant: 256 };
}

/// Built-in cap on live sandboxes: each holds a few daemon descriptors (control socket, log
/// pipe, cgroup files) and a task, so "no limit" would end at the open-file limit instead, with
/// a worse error. 1,000 default sandboxes are a tested load.
pub const DEFAULT_MAX_SANDBOXES: usize = 4096;
/// Built-in per-tenant cap: half of the host's, so one tenant never takes every slot.
pub const DEFAULT_MAX_SANDBOXES_PER_TENANT: usize = 2048;

fn default_max_sandboxes() -> Option<usize> {
    Some(DEFAULT_MAX_SANDBOXES)
}
fn default_max_sandboxes_per_tenant() -> Option<usize> {
    Some(DEFAULT_MAX_SANDBOXES_PER_TENANT)
}

fn default_running_per_sandbox() -> usize {
    ExecCaps::DEFAULTS.running_per_sandbox
}
fn default_background_per_sandbox() -> usize {
    ExecCaps::DEFAULTS.background_per_sandbox
}
fn default_running_per_tenant() -> usize {
    ExecCaps::DEFAULTS.running_per_tenant
}
fn default_background_per_tenant() -> usize {
    ExecCaps::DEFAULTS.background_per_tenant
}

/// The `[policy]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default = "default_isolation")]
    pub default_isolation: Isolation,
    #[serde(default = "all_tiers")]
    pub allowed: Vec<Isolation>,
    /// Sandboxes alive at once (creating, running or failed), all tenants together.
    #[serde(default = "default_max_sandboxes")]
    pub max_sandboxes: Option<usize>,
    /// Sandboxes alive at once per tenant.
    #[serde(default = "default_max_sandboxes_per_tenant")]
    pub max_sandboxes_per_tenant: Option<usize>,
    pub max_concurrent_execs: Option<usize>,
    /// Execs running at once in one sandbox (see [`ExecCaps`]).
    #[serde(default = "default_running_per_sandbox")]
    pub max_running_execs_per_sandbox: usize,
    /// Background execs running at once in one sandbox.
    #[serde(default = "default_background_per_sandbox")]
    pub max_background_execs_per_sandbox: usize,
    /// Execs running at once over all the sandboxes of one tenant.
    #[serde(default = "default_running_per_tenant")]
    pub max_running_execs_per_tenant: usize,
    /// Background execs running at once over all the sandboxes of one tenant.
    #[serde(default = "default_background_per_tenant")]
    pub max_background_execs_per_tenant: usize,
    #[serde(default)]
    pub rules: Vec<toml::Spanned<Rule>>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            default_isolation: default_isolation(),
            allowed: all_tiers(),
            max_sandboxes: default_max_sandboxes(),
            max_sandboxes_per_tenant: default_max_sandboxes_per_tenant(),
            max_concurrent_execs: None,
            max_running_execs_per_sandbox: default_running_per_sandbox(),
            max_background_execs_per_sandbox: default_background_per_sandbox(),
            max_running_execs_per_tenant: default_running_per_tenant(),
            max_background_execs_per_tenant: default_background_per_tenant(),
            rules: Vec::new(),
        }
    }
}

/// Why a request is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("isolation {} is not allowed by policy (allowed: {allowed})", .requested.name())]
    NotAllowed { requested: Isolation, allowed: String },
    #[error("policy rule {rule:?} requires isolation {} or stronger; the request asked for {}", .min.name(), .requested.name())]
    BelowMinimum { rule: String, min: Isolation, requested: Isolation },
    #[error("policy rule {rule:?} allows network up to {}; the sandbox would have {}", .max.name(), .requested.name())]
    NetworkOverMaximum { rule: String, max: NetworkMode, requested: NetworkMode },
    #[error("policy rule {rule:?} does not allow network entry {entry:?} (allowed: {allowed})")]
    NetworkEntryNotAllowed { rule: String, entry: String, allowed: String },
    #[error("network entry {entry:?} lies wholly inside the denied range {range} ([network] deny): it could reach nothing")]
    NetworkEntryDenied { entry: String, range: String },
}

/// A matching rule's network ceiling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkCeiling {
    pub rule: String,
    pub max: NetworkMode,
    /// Empty: any entries (under ALLOWLIST); else only these.
    pub allow: Vec<AllowRule>,
}

/// What the policy decided for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub isolation: Isolation,
    /// Set when a rule raised the isolation: says which and from what.
    pub reason: Option<String>,
    pub defaults: Limits,
    pub ceilings: Limits,
    /// The network ceilings of the matching rules, all of which a sandbox's network must meet.
    pub network_ceilings: Vec<NetworkCeiling>,
    /// The network a matching rule gives a request that names none (and has no parent).
    pub network_default: Option<NetworkPolicy>,
    /// The operator's `[network] deny` ranges: never reachable, whatever a list says.
    pub network_deny: Vec<Cidr>,
}

impl Decision {
    /// The sandbox's network: `asked` (the request's or the parent's), else the matching rules'
    /// default, else NONE — refused if over any matching rule's ceiling.
    pub fn network(&self, asked: Option<NetworkPolicy>) -> Result<NetworkPolicy, PolicyError> {
        let network = asked.or_else(|| self.network_default.clone()).unwrap_or_default();
        for c in &self.network_ceilings {
            if network.mode > c.max {
                return Err(PolicyError::NetworkOverMaximum { rule: c.rule.clone(), max: c.max, requested: network.mode });
            }
            if let Some(entry) = network.allow.iter().find(|e| !c.allow.is_empty() && !c.allow.contains(e)) {
                let allowed = c.allow.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ");
                return Err(PolicyError::NetworkEntryNotAllowed { rule: c.rule.clone(), entry: entry.to_string(), allowed });
            }
        }
        // Deny wins over allow (the egress path checks every connection against the deny
        // ranges). An entry that could reach nothing is a mistake the caller should hear about
        // at create, not a connection refused later; one that overlaps a range only partly
        // keeps its other addresses.
        for entry in &network.allow {
            if let Dest::Cidr(c) = &entry.dest {
                if let Some(range) = self.network_deny.iter().find(|d| d.covers(c)) {
                    return Err(PolicyError::NetworkEntryDenied { entry: entry.to_string(), range: range.to_string() });
                }
            }
        }
        Ok(network)
    }
}

/// The policy in force.
#[derive(Debug, Clone)]
pub struct Policy {
    cfg: PolicyConfig,
    global_defaults: Limits,
    global_ceilings: Limits,
    network_deny: Vec<Cidr>,
}

impl Policy {
    /// A policy over the global `[limits]`.
    pub fn new(cfg: PolicyConfig, global_defaults: Limits, global_ceilings: Limits) -> Self {
        Policy { cfg, global_defaults, global_ceilings, network_deny: Vec::new() }
    }

    /// The operator's `[network] deny` ranges, which an allow-list entry cannot lie wholly
    /// inside.
    pub fn with_network_deny(mut self, deny: Vec<Cidr>) -> Self {
        self.network_deny = deny;
        self
    }

    /// The capacity limits.
    pub fn max_sandboxes(&self) -> Option<usize> {
        self.cfg.max_sandboxes
    }
    pub fn max_sandboxes_per_tenant(&self) -> Option<usize> {
        self.cfg.max_sandboxes_per_tenant
    }
    /// Whether `tier` is among `policy.allowed`.
    pub fn allows(&self, tier: Isolation) -> bool {
        self.cfg.allowed.contains(&tier)
    }
    pub fn max_concurrent_execs(&self) -> Option<usize> {
        self.cfg.max_concurrent_execs
    }
    /// The per-sandbox and per-tenant caps on running and background execs.
    pub fn exec_caps(&self) -> ExecCaps {
        ExecCaps {
            running_per_sandbox: self.cfg.max_running_execs_per_sandbox,
            background_per_sandbox: self.cfg.max_background_execs_per_sandbox,
            running_per_tenant: self.cfg.max_running_execs_per_tenant,
            background_per_tenant: self.cfg.max_background_execs_per_tenant,
        }
    }

    /// Checks the policy against itself and the global limits. `line_of` turns a byte offset of
    /// the config file into a line number, so the message points at the rule.
    pub fn validate(&self, line_of: &dyn Fn(usize) -> usize) -> Result<(), String> {
        let c = &self.cfg;
        if c.allowed.is_empty() {
            return Err("policy.allowed must name at least one isolation".into());
        }
        if !c.allowed.contains(&c.default_isolation) {
            return Err(format!("policy.default_isolation {:?} is not in policy.allowed", c.default_isolation.name()));
        }
        for (name, v) in
            [("max_sandboxes", c.max_sandboxes), ("max_sandboxes_per_tenant", c.max_sandboxes_per_tenant), ("max_concurrent_execs", c.max_concurrent_execs)]
        {
            if v == Some(0) {
                return Err(format!("policy.{name} must be > 0"));
            }
        }
        for (name, v) in [
            ("max_running_execs_per_sandbox", c.max_running_execs_per_sandbox),
            ("max_background_execs_per_sandbox", c.max_background_execs_per_sandbox),
            ("max_running_execs_per_tenant", c.max_running_execs_per_tenant),
            ("max_background_execs_per_tenant", c.max_background_execs_per_tenant),
        ] {
            if v == 0 {
                return Err(format!("policy.{name} must be > 0"));
            }
        }
        let mut names = std::collections::HashSet::new();
        for spanned in &c.rules {
            let line = line_of(spanned.span().start);
            let rule = spanned.get_ref();
            let at = |msg: String| format!("line {line}: policy rule {:?}: {msg}", rule.name);
            if rule.name.is_empty() {
                return Err(format!("line {line}: a policy rule needs a name"));
            }
            if !names.insert(rule.name.clone()) {
                return Err(at("the name is used twice".into()));
            }
            if !rule.network_allow.is_empty() && rule.max_network.is_some_and(|m| m != NetworkMode::Allowlist) {
                return Err(at("network_allow needs max_network = \"allowlist\" (or no max_network)".into()));
            }
            if rule.network_allow.len() > crate::netpolicy::MAX_ALLOW_RULES {
                return Err(at(format!("network_allow has {} entries, at most {}", rule.network_allow.len(), crate::netpolicy::MAX_ALLOW_RULES)));
            }
            if let Some(min) = rule.min_isolation {
                if !c.allowed.iter().any(|a| *a >= min) {
                    return Err(at(format!("min_isolation {} cannot be met: no allowed isolation is that strong", min.name())));
                }
            }
            let ceilings = rule.limits_max.over(self.global_ceilings);
            for ((name, rule_max), (_, global_max)) in fields(&ceilings).into_iter().zip(fields(&self.global_ceilings)) {
                if rule_max > global_max {
                    return Err(at(format!("limits_max.{name} = {rule_max} is above the global ceiling limits.max.{name} = {global_max}")));
                }
                if rule_max == 0 {
                    return Err(at(format!("limits_max.{name} must be > 0")));
                }
            }
            // A ceiling below the floor would refuse every request the rule matches.
            for ((name, rule_max), (_, floor)) in fields(&ceilings).into_iter().zip(fields(&Limits::MINIMUMS)) {
                if rule_max < floor {
                    return Err(at(format!("limits_max.{name} = {rule_max} is below the minimum {floor} a sandbox needs to run anything")));
                }
            }
            let defaults = rule.limits_default.over(self.global_defaults);
            for ((name, d), (_, m)) in fields(&defaults).into_iter().zip(fields(&ceilings)) {
                if rule.limits_default != PartialLimits::default() && ((d == 0 && !zero_default_allowed(name)) || d > m) {
                    return Err(at(format!("limits_default.{name} = {d} must be > 0 and <= its ceiling {m}")));
                }
            }
        }
        Ok(())
    }

    /// Decides the isolation and limits of a request.
    pub fn decide(&self, requested: Option<Isolation>, labels: &BTreeMap<String, String>) -> Result<Decision, PolicyError> {
        let asked = requested.unwrap_or(self.cfg.default_isolation);
        let allowed = || self.cfg.allowed.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ");
        if !self.cfg.allowed.contains(&asked) {
            return Err(PolicyError::NotAllowed { requested: asked, allowed: allowed() });
        }
        let mut isolation = asked;
        let mut reason = None;
        let mut defaults = self.global_defaults;
        let mut ceilings = self.global_ceilings;
        let (mut network_ceilings, mut network_default) = (Vec::new(), None);
        for rule in self.cfg.rules.iter().map(|r| r.get_ref()).filter(|r| r.matches(labels)) {
            if let Some(max) = rule.network_ceiling() {
                network_ceilings.push(NetworkCeiling { rule: rule.name.clone(), max, allow: rule.network_allow.clone() });
            }
            if network_default.is_none() && !rule.network_allow.is_empty() {
                network_default = Some(NetworkPolicy { mode: NetworkMode::Allowlist, allow: rule.network_allow.clone() });
            }
            if let Some(min) = rule.min_isolation {
                if isolation < min {
                    if !rule.upgrade {
                        return Err(PolicyError::BelowMinimum { rule: rule.name.clone(), min, requested: asked });
                    }
                    // The weakest allowed tier that meets the minimum.
                    let Some(&up) = self.cfg.allowed.iter().filter(|a| **a >= min).min() else {
                        return Err(PolicyError::BelowMinimum { rule: rule.name.clone(), min, requested: asked });
                    };
                    reason = Some(format!("upgraded from {} to {} by policy rule {:?}", asked.name(), up.name(), rule.name));
                    isolation = up;
                }
            }
            defaults = rule.limits_default.over(defaults);
            ceilings = min_limits(ceilings, rule.limits_max.over(ceilings));
        }
        Ok(Decision {
            isolation,
            reason,
            defaults: min_limits(defaults, ceilings),
            ceilings,
            network_ceilings,
            network_default,
            network_deny: self.network_deny.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(toml_text: &str) -> Result<Policy, String> {
        #[derive(Deserialize)]
        struct File {
            policy: PolicyConfig,
        }
        let f: File = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        let p = Policy::new(f.policy, Limits::DEFAULTS, Limits::CEILINGS);
        let line_of = |off: usize| toml_text[..off].matches('\n').count() + 1;
        p.validate(&line_of)?;
        Ok(p)
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    const RULES: &str = r#"
[policy]
default_isolation = "process"
allowed = ["process", "container", "microvm"]

[[policy.rules]]
name = "untrusted"
match_labels = { trust = "untrusted" }
min_isolation = "microvm"
upgrade = true
limits_max = { memory_bytes = 1073741824 }

[[policy.rules]]
name = "ci"
match_labels = { team = "ci" }
min_isolation = "container"
upgrade = false
"#;

    #[test]
    fn allowed_request_passes_through() {
        let p = policy(RULES).expect("valid");
        let d = p.decide(Some(Isolation::Container), &labels(&[])).expect("allowed");
        assert_eq!(d.isolation, Isolation::Container);
        assert_eq!(d.reason, None);
        assert_eq!(p.decide(None, &labels(&[])).expect("default").isolation, Isolation::Process);
    }

    #[test]
    fn weaker_request_is_upgraded_with_a_reason_and_tighter_limits() {
        let p = policy(RULES).expect("valid");
        let d = p.decide(Some(Isolation::Process), &labels(&[("trust", "untrusted")])).expect("upgraded");
        assert_eq!(d.isolation, Isolation::MicroVm);
        assert!(d.reason.as_deref().is_some_and(|r| r.contains("untrusted") && r.contains("PROCESS")), "{:?}", d.reason);
        assert_eq!(d.ceilings.memory_bytes, 1 << 30);
    }

    #[test]
    fn weaker_request_is_refused_naming_the_rule_without_upgrade() {
        let p = policy(RULES).expect("valid");
        let err = p.decide(Some(Isolation::Process), &labels(&[("team", "ci")])).expect_err("refused");
        assert!(err.to_string().contains("\"ci\""), "{err}");
        assert!(p.decide(Some(Isolation::MicroVm), &labels(&[("team", "ci")])).is_ok(), "stronger than the minimum is fine");
    }

    #[test]
    fn disallowed_tier_is_refused() {
        let p = policy("[policy]\nallowed = [\"process\"]\n").expect("valid");
        assert!(matches!(p.decide(Some(Isolation::Container), &labels(&[])), Err(PolicyError::NotAllowed { .. })));
    }

    #[test]
    fn invalid_policies_name_the_line() {
        let bad = "[policy]\nallowed = [\"process\"]\n\n[[policy.rules]]\nname = \"vm\"\nmin_isolation = \"microvm\"\n";
        let err = policy(bad).expect_err("unsatisfiable");
        assert!(err.contains("line 4") || err.contains("line 5"), "{err}");
        let err = policy("[policy]\ndefault_isolation = \"hypervisor\"\n").expect_err("unknown tier");
        assert!(err.contains("line 2"), "{err}");
        let err = policy("[policy]\n[[policy.rules]]\nname = \"big\"\nlimits_max = { memory_bytes = 99999999999999999 }\n").expect_err("over ceiling");
        assert!(err.contains("memory_bytes"), "{err}");
        let err = policy("[policy]\n[[policy.rules]]\nname = \"tiny\"\nlimits_max = { max_pids = 2 }\n").expect_err("under the floor");
        assert!(err.contains("tiny") && err.contains("max_pids"), "{err}");
    }

    #[test]
    fn exec_caps_have_defaults_and_refuse_zero() {
        let p = policy("[policy]\n").expect("valid");
        assert_eq!(p.exec_caps(), ExecCaps::DEFAULTS);
        let p = policy("[policy]\nmax_background_execs_per_sandbox = 3\nmax_running_execs_per_tenant = 10\n").expect("valid");
        assert_eq!((p.exec_caps().background_per_sandbox, p.exec_caps().running_per_tenant), (3, 10));
        assert_eq!(p.exec_caps().running_per_sandbox, ExecCaps::DEFAULTS.running_per_sandbox, "unnamed caps keep their default");
        let err = policy("[policy]\nmax_running_execs_per_sandbox = 0\n").expect_err("zero");
        assert!(err.contains("policy.max_running_execs_per_sandbox"), "{err}");
    }

    #[test]
    fn an_allowed_range_wholly_inside_a_denied_one_is_refused_at_create() {
        let deny = vec!["10.0.0.0/8".parse().expect("cidr"), "192.168.7.0/24".parse().expect("cidr")];
        let p = policy("[policy]\n").expect("policy").with_network_deny(deny);
        let d = p.decide(None, &BTreeMap::new()).expect("decide");
        let allow = |entries: &[&str]| NetworkPolicy::new(NetworkMode::Allowlist, &entries.iter().map(|e| e.to_string()).collect::<Vec<_>>()).expect("entries");
        let err = d.network(Some(allow(&["pypi.org:443", "10.1.0.0/16:5432"]))).expect_err("inside 10/8");
        assert_eq!(
            err.to_string(),
            "network entry \"10.1.0.0/16:5432\" lies wholly inside the denied range 10.0.0.0/8 ([network] deny): it could reach nothing"
        );
        assert!(d.network(Some(allow(&["192.168.7.9:80"]))).is_err(), "a single address inside a range");
        // Overlapping only partly, or outside: allowed (deny still wins per connection).
        for ok in ["192.168.0.0/16:80", "0.0.0.0/0:443", "11.0.0.0/8:22", "*.internal.test:443"] {
            assert!(d.network(Some(allow(&[ok]))).is_ok(), "{ok}");
        }
    }

    #[test]
    fn network_rules_bound_what_a_labelled_sandbox_reaches_and_give_it_its_list() {
        let p = policy(
            r#"
[policy]
[[policy.rules]]
name = "untrusted"
match_labels = { trust = "untrusted" }
max_network = "none"

[[policy.rules]]
name = "ci"
match_labels = { team = "ci" }
network_allow = ["pypi.org:443", "*.github.com:443"]
"#,
        )
        .expect("valid");
        let allow = |entries: &[&str]| NetworkPolicy::new(NetworkMode::Allowlist, &entries.iter().map(|e| e.to_string()).collect::<Vec<_>>()).expect("entries");
        // No rule: whatever the request says, NONE by default.
        let free = p.decide(None, &labels(&[])).expect("decide");
        assert_eq!(free.network(None).expect("default"), NetworkPolicy::default());
        let open = NetworkPolicy { mode: NetworkMode::Open, allow: vec![] };
        assert_eq!(free.network(Some(open.clone())).expect("open"), open);
        // Untrusted: nothing but NONE, named in the refusal.
        let untrusted = p.decide(None, &labels(&[("trust", "untrusted")])).expect("decide");
        let err = untrusted.network(Some(allow(&["pypi.org:443"]))).expect_err("over NONE").to_string();
        assert!(err.contains("\"untrusted\"") && err.contains("up to NONE") && err.contains("ALLOWLIST"), "{err}");
        assert_eq!(untrusted.network(None).expect("none").mode, NetworkMode::None);
        // CI: the rule's list when it asks for nothing; a subset of it; nothing else, no OPEN.
        let ci = p.decide(None, &labels(&[("team", "ci")])).expect("decide");
        assert_eq!(ci.network(None).expect("default"), allow(&["pypi.org:443", "*.github.com:443"]));
        assert_eq!(ci.network(Some(allow(&["pypi.org:443"]))).expect("subset"), allow(&["pypi.org:443"]));
        let err = ci.network(Some(allow(&["pypi.org:443", "evil.test:443"]))).expect_err("not listed").to_string();
        assert!(err.contains("\"ci\"") && err.contains("evil.test:443") && err.contains("pypi.org:443"), "{err}");
        let err = ci.network(Some(open)).expect_err("open").to_string();
        assert!(err.contains("up to ALLOWLIST") && err.contains("OPEN"), "{err}");
        // Both rules match: both ceilings hold (the tighter one wins).
        let both = p.decide(None, &labels(&[("team", "ci"), ("trust", "untrusted")])).expect("decide");
        assert!(both.network(None).is_err(), "the CI list is over the untrusted rule's NONE");
        // A list needs ALLOWLIST; a bad entry is named at load.
        let err = policy("[policy]\n[[policy.rules]]\nname = \"x\"\nmax_network = \"open\"\nnetwork_allow = [\"a.test:1\"]\n").expect_err("open with a list");
        assert!(err.contains("network_allow needs max_network"), "{err}");
        let err = policy("[policy]\n[[policy.rules]]\nname = \"x\"\nnetwork_allow = [\"a.test\"]\n").expect_err("no port");
        assert!(err.contains("a.test"), "{err}");
    }
}
