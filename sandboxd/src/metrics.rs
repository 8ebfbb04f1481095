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
}

fn state_label(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Creating => "creating",
        SandboxState::Running => "running",
        SandboxState::Failed => "failed",
        SandboxState::Destroyed => "destroyed",
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
        Ok(Arc::new(Metrics { registry, execs, oom_kills, timeouts, latency, sandboxes, tier_available }))
    }

    /// An exec ended.
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

    /// The text exposition, with the state gauges set from `sandboxes` and `tiers` first.
    pub fn render(&self, sandboxes: &[(Isolation, SandboxState)], tiers: &[(Isolation, bool)]) -> String {
        self.sandboxes.reset();
        for tier in Isolation::ALL {
            for state in [SandboxState::Creating, SandboxState::Running, SandboxState::Failed] {
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
}
