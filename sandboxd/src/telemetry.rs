//! OpenTelemetry trace export over OTLP/gRPC, on when `[telemetry] otlp_endpoint` is set.
//!
//! The daemon's `tracing` spans (one per RPC, the manager's operations under it) become
//! OpenTelemetry spans through a `tracing-opentelemetry` layer and leave in batches. The RPC span
//! continues the caller's W3C trace ([`continue_trace`]): its trace id is the caller's and its
//! parent the caller's span, so an agent's trace and the daemon's work form one tree.
//!
//! Export is best effort: batches are sent from the SDK's own thread, so a collector that is
//! slow or down costs an error line per batch and dropped spans, never an RPC.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanExporter};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;

use crate::config::TelemetryConfig;
use crate::model::TraceContext;

/// One export (with the exporter's retries) gives up after this long.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Shutdown waits this long for the last batch; a collector that is down must not hold up the
/// daemon's exit.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors starting the export pipeline.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("building the OTLP exporter for {endpoint}: {source}")]
    Exporter { endpoint: String, source: opentelemetry_otlp::ExporterBuildError },
}

/// The running export pipeline. Call [`Telemetry::shutdown`] before exiting, or the last batch
/// is lost.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Starts OTLP/gRPC export to `cfg.otlp_endpoint`, or returns `None` when it is not set.
    ///
    /// Call it inside a Tokio runtime that outlives [`Telemetry::shutdown`]: the exporter's gRPC
    /// channel is a task on it (the connection is made lazily, so a collector that is down does
    /// not stop the daemon from starting).
    pub fn start(cfg: &TelemetryConfig) -> Result<Option<Telemetry>, TelemetryError> {
        let Some(endpoint) = &cfg.otlp_endpoint else { return Ok(None) };
        let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(endpoint).with_timeout(EXPORT_TIMEOUT);
        if endpoint.starts_with("https://") {
            exporter = exporter.with_tls_config(tonic::transport::ClientTlsConfig::new().with_enabled_roots());
        }
        let exporter = exporter.build().map_err(|source| TelemetryError::Exporter { endpoint: endpoint.clone(), source })?;
        Ok(Some(Self::with_exporter(cfg, exporter)))
    }

    fn with_exporter(cfg: &TelemetryConfig, exporter: impl SpanExporter + 'static) -> Telemetry {
        let batches = BatchConfigBuilder::default().with_scheduled_delay(Duration::from_millis(cfg.batch_delay_ms)).build();
        let resource =
            Resource::builder().with_service_name(cfg.service_name.clone()).with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION"))).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).with_batch_config(batches).build())
            // The ratio decides only for traces the daemon starts; a caller's decision (the
            // sampled flag of its traceparent) is followed so its trace is never cut in two.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio))))
            .with_resource(resource)
            .build();
        Telemetry { provider }
    }

    /// The subscriber layer turning the daemon's spans into OpenTelemetry spans.
    ///
    /// Only the daemon's own spans and events go through: the exporter's gRPC stack (tonic, h2,
    /// hyper) traces too, and exporting those would make every export produce spans to export.
    pub fn layer<S>(&self) -> impl Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("sandboxd"))
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| meta.target().starts_with("sandboxd")))
    }

    /// Exports what is still queued and stops the export thread, waiting at most
    /// [`SHUTDOWN_TIMEOUT`]. Failures are logged: a lost batch never fails the daemon's exit.
    pub fn shutdown(self) {
        match self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            Ok(()) => tracing::info!("trace export flushed and stopped"),
            Err(e) => tracing::warn!(error = %e, "trace export stopped; the last spans may be lost"),
        }
    }
}

/// Makes `span`, the span of one RPC, continue the caller's trace: its parent becomes the span
/// named by the request's W3C `traceparent` (and `tracestate`), its OpenTelemetry name the RPC
/// (`sandbox.v1.SandboxService/CreateSandbox`) and its kind `server`. Without export (no
/// OpenTelemetry layer in the subscriber) it does nothing, so log lines stay as they were.
///
/// `span` must declare the fields `otel.name` and `otel.kind` (empty) and not have been entered.
pub fn continue_trace(span: &tracing::Span, rpc: &str, headers: &http::HeaderMap) {
    // No or a malformed traceparent extracts an empty context: the span starts a new trace.
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if span.set_parent(parent).is_ok() {
        span.record("otel.name", rpc.trim_start_matches('/'));
        span.record("otel.kind", "server");
    }
}

/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>` → (trace id, parent id); None for
/// anything else, the all-zero trace id included.
pub fn parse_traceparent(v: &str) -> Option<(&str, &str)> {
    let mut parts = v.trim().split('-');
    let (version, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2) && trace.bytes().any(|b| b != b'0')).then_some((trace, parent))
}

/// The caller's trace (trace id and its span) from a request's `traceparent`, lower-cased, for
/// the audit line and the exec record; None without one or with a malformed one.
pub fn caller_trace(headers: &http::HeaderMap) -> Option<TraceContext> {
    let (trace, span) = headers.get("traceparent").and_then(|v| v.to_str().ok()).and_then(parse_traceparent)?;
    Some(TraceContext { trace_id: trace.to_ascii_lowercase(), span_id: span.to_ascii_lowercase() })
}

/// Reads propagation headers from gRPC metadata (HTTP/2 headers).
struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanId, SpanKind, TraceId};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::SpanData;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT_ID: &str = "00f067aa0ba902b7";
    const RPC: &str = "/sandbox.v1.SandboxService/CreateSandbox";

    /// Keeps what the batch processor exports, and the resource it was given.
    #[derive(Debug, Clone, Default)]
    struct Capture {
        spans: Arc<Mutex<Vec<SpanData>>>,
        resource: Arc<Mutex<Option<Resource>>>,
    }

    impl SpanExporter for Capture {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.spans.lock().expect("lock").extend(batch);
            Ok(())
        }

        fn set_resource(&mut self, resource: &Resource) {
            *self.resource.lock().expect("lock") = Some(resource.clone());
        }
    }

    fn config(sample_ratio: f64) -> TelemetryConfig {
        TelemetryConfig { service_name: "sandboxd-test".into(), sample_ratio, ..Default::default() }
    }

    fn headers(traceparent: Option<&str>) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        if let Some(tp) = traceparent {
            h.insert("traceparent", tp.parse().expect("header value"));
        }
        h
    }

    /// Runs one RPC-shaped span (as `server::rpc_span` makes it) with a child inside, and a
    /// span of a foreign crate, through a pipeline exporting into a `Capture`.
    fn run_rpc(cfg: &TelemetryConfig, traceparent: Option<&str>) -> Capture {
        let capture = Capture::default();
        let telemetry = Telemetry::with_exporter(cfg, capture.clone());
        let subscriber = tracing_subscriber::registry().with(telemetry.layer());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("rpc", method = RPC, otel.name = tracing::field::Empty, otel.kind = tracing::field::Empty);
            continue_trace(&span, RPC, &headers(traceparent));
            span.in_scope(|| {
                tracing::info_span!("manager.create").in_scope(|| tracing::info!("created"));
                tracing::info_span!(target: "h2", "connection").in_scope(|| {});
            });
        });
        telemetry.provider.force_flush().expect("flush");
        telemetry.shutdown();
        capture
    }

    fn by_name<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no span {name:?} in {spans:#?}"))
    }

    #[test]
    fn the_rpc_span_continues_the_callers_trace_and_children_follow() {
        let capture = run_rpc(&config(1.0), Some(&format!("00-{TRACE_ID}-{PARENT_ID}-01")));
        let spans = capture.spans.lock().expect("lock").clone();
        let rpc = by_name(&spans, "sandbox.v1.SandboxService/CreateSandbox");
        assert_eq!(rpc.span_context.trace_id(), TraceId::from_hex(TRACE_ID).expect("hex"));
        assert_eq!(rpc.parent_span_id, SpanId::from_hex(PARENT_ID).expect("hex"));
        assert!(rpc.parent_span_is_remote);
        assert_eq!(rpc.span_kind, SpanKind::Server);
        let child = by_name(&spans, "manager.create");
        assert_eq!(child.span_context.trace_id(), rpc.span_context.trace_id());
        assert_eq!(child.parent_span_id, rpc.span_context.span_id());
        assert_eq!(child.events.len(), 1, "the log line inside is a span event");
        assert_eq!(spans.len(), 2, "the foreign crate's span is not exported: {spans:#?}");
        let resource = capture.resource.lock().expect("lock").clone().expect("resource");
        let attr = |k: &'static str| resource.get(&opentelemetry::Key::from_static_str(k)).map(|v| v.to_string());
        assert_eq!(attr("service.name").as_deref(), Some("sandboxd-test"));
        assert_eq!(attr("service.version").as_deref(), Some(env!("CARGO_PKG_VERSION")));
    }

    #[test]
    fn without_a_traceparent_the_rpc_starts_a_trace_subject_to_the_ratio() {
        let capture = run_rpc(&config(1.0), None);
        let spans = capture.spans.lock().expect("lock").clone();
        let rpc = by_name(&spans, "sandbox.v1.SandboxService/CreateSandbox");
        assert_eq!(rpc.parent_span_id, SpanId::INVALID, "a root span");
        assert!(rpc.span_context.trace_id() != TraceId::INVALID);
        let garbage = run_rpc(&config(1.0), Some("00-garbage"));
        assert_eq!(by_name(&garbage.spans.lock().expect("lock"), "sandbox.v1.SandboxService/CreateSandbox").parent_span_id, SpanId::INVALID);

        // Ratio 0: the daemon starts no trace of its own, but a sampled caller's trace goes on.
        assert!(run_rpc(&config(0.0), None).spans.lock().expect("lock").is_empty());
        let sampled = run_rpc(&config(0.0), Some(&format!("00-{TRACE_ID}-{PARENT_ID}-01")));
        assert_eq!(sampled.spans.lock().expect("lock").len(), 2);
        let unsampled = run_rpc(&config(1.0), Some(&format!("00-{TRACE_ID}-{PARENT_ID}-00")));
        assert!(unsampled.spans.lock().expect("lock").is_empty(), "the caller decided not to sample");
    }

    #[test]
    fn without_export_continue_trace_leaves_the_span_alone() {
        let fields = Arc::new(Mutex::new(Vec::new()));
        let seen = fields.clone();
        let log = tracing_subscriber::fmt::layer().with_writer(move || RecordWriter(seen.clone()));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(log), || {
            let span = tracing::info_span!("rpc", otel.name = tracing::field::Empty, otel.kind = tracing::field::Empty);
            continue_trace(&span, RPC, &headers(Some(&format!("00-{TRACE_ID}-{PARENT_ID}-01"))));
            span.in_scope(|| tracing::info!("inside"));
        });
        let out = String::from_utf8(fields.lock().expect("lock").clone()).expect("utf8");
        assert!(out.contains("inside") && !out.contains("otel."), "{out}");
    }

    struct RecordWriter(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for RecordWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn traceparent_parses_and_rejects_garbage() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(parse_traceparent(tp), Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")));
        assert_eq!(parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
        assert_eq!(parse_traceparent("garbage"), None);
        let caller = caller_trace(&headers(Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"))).expect("a trace");
        assert_eq!((caller.trace_id.as_str(), caller.span_id.as_str()), ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"));
        assert_eq!(caller_trace(&headers(Some("00-garbage"))), None);
        assert_eq!(caller_trace(&headers(None)), None);
    }

    #[tokio::test]
    async fn an_unreachable_collector_is_not_an_error_at_start() {
        let cfg = TelemetryConfig { otlp_endpoint: Some("http://127.0.0.1:1".into()), batch_delay_ms: 50, ..Default::default() };
        let telemetry = Telemetry::start(&cfg).expect("lazy connection").expect("export on");
        let started = std::time::Instant::now();
        tokio::task::spawn_blocking(move || telemetry.shutdown()).await.expect("shutdown");
        assert!(started.elapsed() < SHUTDOWN_TIMEOUT + Duration::from_secs(1));
        assert!(Telemetry::start(&TelemetryConfig::default()).expect("off").is_none());
    }
}
