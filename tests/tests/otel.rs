//! End to end: OpenTelemetry export. The daemon sends its RPC spans over OTLP/gRPC to a fake
//! collector running in this test, continuing the caller's W3C trace; a collector that is down
//! never gets in the way of the RPCs.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use sandbox_tests::{eventually, free_port, process_sandbox, proto, Daemon};

const SERVICE: &str = "sandboxd-otel-test";
const CREATE: &str = "sandbox.v1.SandboxService/CreateSandbox";
const LIST: &str = "sandbox.v1.SandboxService/ListSandboxes";

/// One span as the collector received it, with the `service.name` of its resource.
#[derive(Debug, Clone)]
struct Received {
    service_name: String,
    span: Span,
}

/// A fake OTLP collector: the TraceService gRPC server, keeping every span it is sent.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(&self, request: tonic::Request<ExportTraceServiceRequest>) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().map_err(|_| tonic::Status::internal("poisoned"))?;
        for rs in request.into_inner().resource_spans {
            let service_name = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(Received { service_name: service_name.clone(), span });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    /// Serves on 127.0.0.1:<free port> until the test ends; returns the collector and its URL.
    async fn start() -> (Collector, String) {
        let incoming = tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().expect("addr")).expect("bind collector");
        let addr = incoming.local_addr().expect("local addr");
        let collector = Collector::default();
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(async move { tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await });
        (collector, format!("http://{addr}"))
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits (up to `within`) for a span that `pred` accepts.
    async fn wait_for(&self, within: Duration, pred: impl Fn(&Received) -> bool) -> Option<Received> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = self.spans().into_iter().find(&pred) {
                return Some(found);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn telemetry_toml(endpoint: &str, batch_delay_ms: u64) -> String {
    format!("[telemetry]\notlp_endpoint = \"{endpoint}\"\nservice_name = \"{SERVICE}\"\nbatch_delay_ms = {batch_delay_ms}\n")
}

fn with_traceparent<T>(message: T, trace_id: &str, parent_id: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut().insert("traceparent", format!("00-{trace_id}-{parent_id}-01").parse().expect("header"));
    req
}

fn describe(spans: &[Received]) -> String {
    spans
        .iter()
        .map(|r| {
            format!(
                "{} trace={} span={} parent={} service={}",
                r.span.name,
                hex(&r.span.trace_id),
                hex(&r.span.span_id),
                hex(&r.span.parent_span_id),
                r.service_name
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread")]
async fn rpc_spans_reach_the_collector_in_the_callers_trace() {
    let (collector, endpoint) = Collector::start().await;
    let daemon = Daemon::start_with(&telemetry_toml(&endpoint, 200), &[]).await.expect("daemon");
    let mut raw = daemon.client().await.expect("client").raw();

    let (trace_id, parent_id) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    raw.create_sandbox(with_traceparent(process_sandbox("minimal"), trace_id, parent_id)).await.expect("create");

    let rpc = collector.wait_for(Duration::from_secs(15), |r| hex(&r.span.trace_id) == trace_id && r.span.name == CREATE).await.unwrap_or_else(|| {
        panic!("no CreateSandbox span in trace {trace_id} within 15 s; collector got:\n{}\ndaemon log:\n{}", describe(&collector.spans()), daemon.log())
    });
    assert_eq!(hex(&rpc.span.parent_span_id), parent_id, "the caller's span is the parent");
    assert_eq!(rpc.service_name, SERVICE);
    assert_eq!(rpc.span.kind, opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32);

    // The manager's work is a child of the RPC span, in the same trace.
    let rpc_id = rpc.span.span_id.clone();
    let child = collector
        .wait_for(Duration::from_secs(5), |r| r.span.name == "manager.create" && r.span.parent_span_id == rpc_id)
        .await
        .unwrap_or_else(|| panic!("no manager.create span under the RPC span; collector got:\n{}", describe(&collector.spans())));
    assert_eq!(hex(&child.span.trace_id), trace_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_last_spans_are_flushed_at_shutdown() {
    let (collector, endpoint) = Collector::start().await;
    // A batch delay far beyond the test: only the flush at shutdown can deliver the span.
    let mut daemon = Daemon::start_with(&telemetry_toml(&endpoint, 600_000), &[]).await.expect("daemon");
    let mut raw = daemon.client().await.expect("client").raw();
    let (trace_id, parent_id) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    raw.list_sandboxes(with_traceparent(proto::ListSandboxesRequest::default(), trace_id, parent_id)).await.expect("list");
    let is_ours = |r: &Received| hex(&r.span.trace_id) == trace_id && r.span.name == LIST;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(collector.spans().iter().all(|r| !is_ours(r)), "exported before shutdown: the batch delay is not applied");

    let status = daemon.stop().expect("stop");
    assert!(status.success(), "{status}");
    let rpc = collector.wait_for(Duration::from_secs(2), is_ours).await.unwrap_or_else(|| {
        panic!("the ListSandboxes span was not flushed at shutdown; collector got:\n{}\ndaemon log:\n{}", describe(&collector.spans()), daemon.log())
    });
    assert_eq!(hex(&rpc.span.parent_span_id), parent_id);
    assert_eq!(rpc.service_name, SERVICE);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_collector_does_not_get_in_the_way() {
    let nobody = format!("http://127.0.0.1:{}", free_port().expect("port"));
    let mut daemon = Daemon::start_with(&telemetry_toml(&nobody, 100), &[]).await.expect("starts without its collector");
    let client = daemon.client().await.expect("client");
    let mut raw = client.raw();
    // Across several failed exports, every RPC answers promptly.
    for i in 0..10 {
        let started = Instant::now();
        raw.list_sandboxes(with_traceparent(proto::ListSandboxesRequest::default(), "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
            .await
            .expect("list");
        assert!(started.elapsed() < Duration::from_secs(2), "RPC {i} took {:?}", started.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sb = client.create(process_sandbox("minimal")).await.expect("create");
    client.destroy(&sb.id).await.expect("destroy");

    let logged = eventually(15, || async { daemon.log().contains("ExportError") }).await;
    assert!(logged, "the failed exports are not logged:\n{}", daemon.log());

    // Shutdown gives up on the last batch within its bound instead of hanging.
    let started = Instant::now();
    let status = daemon.stop().expect("stop");
    assert!(status.success(), "{status}");
    assert!(started.elapsed() < Duration::from_secs(15), "stop took {:?}", started.elapsed());
}
