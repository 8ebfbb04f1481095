//! Prometheus metrics: what the daemon counts, and the HTTP endpoint that serves them.
//!
//! Counters and histograms are updated where things happen (the manager); gauges that describe
//! current state (sandboxes by tier and state, tier availability) are computed at scrape time
//! from a snapshot callback, so they can never drift from the truth.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus::{Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};

use crate::model::{ExecStatus, Isolation, SandboxState};

/// The daemon's metrics.
pub struct Metrics {
    registry: Registry,
    execs: IntCounterVec,
    oom_kills: IntCounter,
    timeouts: IntCounter,
    latency: HistogramVec,
    sandboxes: GaugeVec,
    tier_available: GaugeVec,
    pool_bytes: GaugeVec,
    host: GaugeVec,
    pressure: GaugeVec,
}

/// One storage pool as admission sees it, for the gauges.
#[derive(Debug, Clone)]
pub struct PoolGauge {
    /// The config key sizing it (the `pool` label).
    pub key: String,
    pub capacity: u64,
    /// capacity × `admission.disk_overcommit`.
    pub promisable: u64,
    pub promised: u64,
    /// Real use (layers and snapshots), when measurable.
    pub used: Option<u64>,
    /// 0 ok, 1 past `admission.disk_warn`, 2 past `admission.disk_high_water` (creates refused).
    pub pressure: u8,
}

/// What admission counts now, for the gauges.
#[derive(Debug, Clone, Default)]
pub struct AdmissionGauges {
    pub pools: Vec<PoolGauge>,
    pub memory_promised: u64,
    pub memory_promisable: u64,
    pub memory_available: Option<u64>,
    pub pids_promised: u64,
    pub pids_promisable: u64,
    pub tasks: Option<u64>,
    /// 0 ok, 1 near, 2 at the limit (creates refused).
    pub memory_pressure: u8,
    pub pids_pressure: u8,
}

fn state_label(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Creating => "creating",
        SandboxState::Running => "running",
        SandboxState::Failed => "failed",
        SandboxState::Destroyed => "destroyed",
        SandboxState::Paused => "paused",
    }
}

/// Operations whose latency is measured.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Create,
    Exec,
    Snapshot,
    Rollback,
    Destroy,
}

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Exec => "exec",
            Op::Snapshot => "snapshot",
            Op::Rollback => "rollback",
            Op::Destroy => "destroy",
        }
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Result<Arc<Self>, prometheus::Error> {
        let registry = Registry::new_custom(Some("sandboxd".into()), None)?;
        let execs = IntCounterVec::new(Opts::new("execs_total", "Execs ended, by status"), &["status"])?;
        let oom_kills = IntCounter::new("oom_kills_total", "Execs that ended OOM_KILLED")?;
        let timeouts = IntCounter::new("exec_timeouts_total", "Execs that ended TIMED_OUT")?;
        let buckets = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0];
        let latency = HistogramVec::new(HistogramOpts::new("operation_duration_seconds", "Latency of operations, by kind").buckets(buckets), &["op", "tier"])?;
        let sandboxes = GaugeVec::new(Opts::new("sandboxes", "Sandboxes, by tier and state"), &["tier", "state"])?;
        let tier_available = GaugeVec::new(Opts::new("tier_available", "1 when this host can run the tier"), &["tier"])?;
        registry.register(Box::new(execs.clone()))?;
        registry.register(Box::new(oom_kills.clone()))?;
        registry.register(Box::new(timeouts.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(sandboxes.clone()))?;
        registry.register(Box::new(tier_available.clone()))?;
        let pool_bytes = GaugeVec::new(
            Opts::new(
                "pool_bytes",
                "Storage pools: capacity, promisable (capacity × admission.disk_overcommit), promised (sum of disk_bytes), used (real, snapshots included)",
            ),
            &["pool", "kind"],
        )?;
        let host = GaugeVec::new(
            Opts::new("host_admission", "Memory (bytes) and pids: promised to sandboxes, promisable, and free on the host now (memory_available, tasks)"),
            &["resource", "kind"],
        )?;
        let pressure = GaugeVec::new(Opts::new("admission_pressure", "0 ok, 1 nearing the limit (warned), 2 at the limit (creates refused)"), &["resource"])?;
        registry.register(Box::new(pool_bytes.clone()))?;
        registry.register(Box::new(host.clone()))?;
        registry.register(Box::new(pressure.clone()))?;
        Ok(Arc::new(Metrics { registry, execs, oom_kills, timeouts, latency, sandboxes, tier_available, pool_bytes, host, pressure }))
    }

    /// An exec ended.
    /// The registry `/metrics` renders, for subsystems with counters of their own (egress).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn exec_ended(&self, tier: Isolation, status: ExecStatus, duration: Duration) {
        self.execs.with_label_values(&[status.name()]).inc();
        match status {
            ExecStatus::OomKilled => self.oom_kills.inc(),
            ExecStatus::TimedOut => self.timeouts.inc(),
            _ => {}
        }
        self.observe(Op::Exec, tier, duration);
    }

    /// An operation took `d`.
    pub fn observe(&self, op: Op, tier: Isolation, d: Duration) {
        self.latency.with_label_values(&[op.label(), &tier.name().to_lowercase()]).observe(d.as_secs_f64());
    }

    /// Sets the admission gauges (before [`Metrics::render`]).
    pub fn set_admission(&self, a: &AdmissionGauges) {
        self.pool_bytes.reset();
        self.pressure.reset();
        for p in &a.pools {
            let key = p.key.as_str();
            for (kind, v) in [("capacity", Some(p.capacity)), ("promisable", Some(p.promisable)), ("promised", Some(p.promised)), ("used", p.used)] {
                if let Some(v) = v {
                    self.pool_bytes.with_label_values(&[key, kind]).set(v as f64);
                }
            }
            self.pressure.with_label_values(&[&format!("pool:{key}")]).set(p.pressure.into());
        }
        for (resource, kind, v) in [
            ("memory", "promised", Some(a.memory_promised)),
            ("memory", "promisable", Some(a.memory_promisable)),
            ("memory", "available", a.memory_available),
            ("pids", "promised", Some(a.pids_promised)),
            ("pids", "promisable", Some(a.pids_promisable)),
            ("pids", "tasks", a.tasks),
        ] {
            if let Some(v) = v {
                self.host.with_label_values(&[resource, kind]).set(v as f64);
            }
        }
        self.pressure.with_label_values(&["memory"]).set(a.memory_pressure.into());
        self.pressure.with_label_values(&["pids"]).set(a.pids_pressure.into());
    }

    /// The text exposition, with the state gauges set from `sandboxes` and `tiers` first.
    pub fn render(&self, sandboxes: &[(Isolation, SandboxState)], tiers: &[(Isolation, bool)]) -> String {
        self.sandboxes.reset();
        for tier in Isolation::ALL {
            for state in [SandboxState::Creating, SandboxState::Running, SandboxState::Paused, SandboxState::Failed] {
                let n = sandboxes.iter().filter(|(t, s)| *t == tier && *s == state).count();
                self.sandboxes.with_label_values(&[&tier.name().to_lowercase(), state_label(state)]).set(n as f64);
            }
        }
        for (tier, up) in tiers {
            self.tier_available.with_label_values(&[&tier.name().to_lowercase()]).set(if *up { 1.0 } else { 0.0 });
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "encoding metrics");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Serves `GET /metrics` on `listener` until `stop` fires. `render` produces the body.
pub async fn serve(
    listener: tokio::net::TcpListener,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = listener.accept() => r?,
        };
        let render = render.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let render = render.clone();
                async move {
                    let resp = if req.uri().path() == "/metrics" {
                        hyper::Response::builder().header("content-type", "text/plain; version=0.0.4").body(Full::new(Bytes::from(render())))
                    } else {
                        hyper::Response::builder().status(404).body(Full::new(Bytes::from_static(b"see /metrics\n")))
                    };
                    Ok::<_, Infallible>(resp.unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new()))))
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await {
                tracing::debug!(error = %e, "metrics connection");
            }
        });
    }
}

/// The metrics an operator's overview shows (the rest are on the metrics listener): the page's
/// Health section, and each fleet node's status for its peers' pages.
const KEY_METRICS: &[&str] =
    &["sandboxd_execs_total", "sandboxd_oom_kills_total", "sandboxd_exec_timeouts_total", "sandboxd_admission_pressure", "sandboxd_host_admission"];

/// One sample of a key metric.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySample {
    /// The metric's name.
    pub name: String,
    /// Its labels as written (`a="x",b="y"`), empty when none.
    pub labels: String,
    /// The value.
    pub value: f64,
}

/// The samples of [`KEY_METRICS`] in a Prometheus text exposition.
pub fn key_samples(text: &str) -> Vec<KeySample> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| KEY_METRICS.iter().any(|m| l.strip_prefix(m).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            Some(KeySample { name: name.to_string(), labels: labels.to_string(), value: value.parse::<f64>().ok()? })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering_includes_counters_and_state_gauges() {
        let m = Metrics::new().expect("metrics");
        m.exec_ended(Isolation::Process, ExecStatus::OomKilled, Duration::from_millis(3));
        m.observe(Op::Create, Isolation::Process, Duration::from_millis(12));
        let text = m.render(&[(Isolation::Process, SandboxState::Running)], &[(Isolation::Process, true), (Isolation::MicroVm, false)]);
        assert!(text.contains("sandboxd_execs_total{status=\"oom_killed\"} 1"), "{text}");
        assert!(text.contains("sandboxd_oom_kills_total 1"));
        assert!(text.contains("sandboxd_sandboxes{state=\"running\",tier=\"process\"} 1"));
        assert!(text.contains("sandboxd_tier_available{tier=\"microvm\"} 0"));
        assert!(text.contains("sandboxd_operation_duration_seconds_bucket{op=\"create\""));
    }

    #[test]
    fn admission_gauges_show_pools_and_pressure() {
        let m = Metrics::new().expect("metrics");
        let pool = PoolGauge { key: "pool_size_bytes".into(), capacity: 100, promisable: 3200, promised: 1000, used: Some(85), pressure: 1 };
        m.set_admission(&AdmissionGauges { pools: vec![pool], memory_promised: 7, memory_available: Some(9), memory_pressure: 2, ..Default::default() });
        let text = m.render(&[], &[]);
        assert!(text.contains("sandboxd_pool_bytes{kind=\"used\",pool=\"pool_size_bytes\"} 85"), "{text}");
        assert!(text.contains("sandboxd_pool_bytes{kind=\"promisable\",pool=\"pool_size_bytes\"} 3200"), "{text}");
        assert!(text.contains("sandboxd_admission_pressure{resource=\"pool:pool_size_bytes\"} 1"), "{text}");
        assert!(text.contains("sandboxd_admission_pressure{resource=\"memory\"} 2"), "{text}");
        assert!(text.contains("sandboxd_host_admission{kind=\"available\",resource=\"memory\"} 9"), "{text}");
        assert!(!text.contains("kind=\"tasks\""), "an unmeasured value is left out, not 0: {text}");
    }
}
