//! The gRPC edge: each handler turns a protobuf message into a core call and the result back.

mod convert;
mod status;

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use sandbox_proto::v1 as pb;
use sandbox_proto::v1::sandbox_service_server::SandboxService;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::backend::OutputChunk;
use crate::manager::Manager;

pub use convert::{exec_request, isolation_from_proto};

/// The `sandbox.v1.SandboxService` implementation.
pub struct Api {
    manager: Arc<Manager>,
}

impl Api {
    /// Serves `manager`.
    pub fn new(manager: Arc<Manager>) -> Self {
        Api { manager }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ExecEvent, Status>> + Send>>;

#[tonic::async_trait]
impl SandboxService for Api {
    async fn create_sandbox(&self, request: Request<pb::CreateSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let req = convert::create_request(request.into_inner())?;
        let info = self.manager.create(req).await?;
        Ok(Response::new(convert::sandbox(&info)))
    }

    async fn get_sandbox(&self, request: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let info = self.manager.get(&request.into_inner().sandbox_id)?;
        Ok(Response::new(convert::sandbox(&info)))
    }

    async fn list_sandboxes(&self, request: Request<pb::ListSandboxesRequest>) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let selector = request.into_inner().label_selector.into_iter().collect();
        let list = self.manager.list(&selector)?;
        Ok(Response::new(pb::ListSandboxesResponse { sandboxes: list.iter().map(convert::sandbox).collect() }))
    }

    async fn destroy_sandbox(&self, request: Request<pb::DestroySandboxRequest>) -> Result<Response<pb::DestroySandboxResponse>, Status> {
        self.manager.destroy(&request.into_inner().sandbox_id).await?;
        Ok(Response::new(pb::DestroySandboxResponse {}))
    }

    async fn exec(&self, request: Request<pb::ExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        let req = exec_request(request.into_inner());
        let record = self.manager.exec(req, None).await?;
        Ok(Response::new(convert::exec_result(&record, true)))
    }

    type ExecStreamStream = EventStream;

    async fn exec_stream(&self, request: Request<pb::ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        let req = exec_request(request.into_inner());
        // Validate before the stream starts, so bad input is a status, not a broken stream.
        self.manager.get(&req.sandbox_id)?;
        let (chunk_tx, mut chunk_rx) = mpsc::channel::<OutputChunk>(16);
        let (event_tx, event_rx) = mpsc::channel::<Result<pb::ExecEvent, Status>>(16);
        let manager = self.manager.clone();
        tokio::spawn(async move {
            let exec = manager.exec(req, Some(chunk_tx));
            tokio::pin!(exec);
            let mut streamed = false;
            let result = loop {
                tokio::select! {
                    r = &mut exec => break r,
                    // The client went away: returning drops `exec`, which kills the command.
                    _ = event_tx.closed() => return,
                    Some(chunk) = chunk_rx.recv() => {
                        streamed = true;
                        let event = match chunk {
                            OutputChunk::Stdout(b) => pb::exec_event::Event::Stdout(b.to_vec()),
                            OutputChunk::Stderr(b) => pb::exec_event::Event::Stderr(b.to_vec()),
                        };
                        // The client went away: returning drops `exec`, which kills the command.
                        if event_tx.send(Ok(pb::ExecEvent { event: Some(event) })).await.is_err() {
                            return;
                        }
                    }
                }
            };
            // Output still queued after the exec ended.
            while let Ok(chunk) = chunk_rx.try_recv() {
                streamed = true;
                let event = match chunk {
                    OutputChunk::Stdout(b) => pb::exec_event::Event::Stdout(b.to_vec()),
                    OutputChunk::Stderr(b) => pb::exec_event::Event::Stderr(b.to_vec()),
                };
                if event_tx.send(Ok(pb::ExecEvent { event: Some(event) })).await.is_err() {
                    return;
                }
            }
            let last = match result {
                Ok(record) => {
                    // A replayed idempotent exec streamed nothing: send its recorded output first.
                    if !streamed {
                        for event in [
                            pb::exec_event::Event::Stdout(record.outcome.stdout.bytes.clone()),
                            pb::exec_event::Event::Stderr(record.outcome.stderr.bytes.clone()),
                        ] {
                            let empty = matches!(&event, pb::exec_event::Event::Stdout(b) | pb::exec_event::Event::Stderr(b) if b.is_empty());
                            if !empty && event_tx.send(Ok(pb::ExecEvent { event: Some(event) })).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(pb::ExecEvent { event: Some(pb::exec_event::Event::Result(convert::exec_result(&record, false))) })
                }
                Err(e) => Err(Status::from(e)),
            };
            let _ = event_tx.send(last).await;
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(event_rx))))
    }

    async fn get_exec(&self, request: Request<pb::GetExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        let req = request.into_inner();
        let record = self.manager.get_exec(&req.exec_id, req.wait).await?;
        Ok(Response::new(convert::exec_result(&record, true)))
    }

    async fn signal_exec(&self, request: Request<pb::SignalExecRequest>) -> Result<Response<pb::SignalExecResponse>, Status> {
        let req = request.into_inner();
        self.manager.signal_exec(&req.exec_id, req.signal).await?;
        Ok(Response::new(pb::SignalExecResponse {}))
    }

    async fn list_execs(&self, request: Request<pb::ListExecsRequest>) -> Result<Response<pb::ListExecsResponse>, Status> {
        let req = request.into_inner();
        let records = self.manager.list_execs(&req.sandbox_id, req.limit)?;
        Ok(Response::new(pb::ListExecsResponse { execs: records.iter().map(|r| convert::exec_result(r, true)).collect() }))
    }

    async fn write_file(&self, request: Request<pb::WriteFileRequest>) -> Result<Response<pb::WriteFileResponse>, Status> {
        let req = request.into_inner();
        let n = self.manager.write_file(&req.sandbox_id, &req.path, &req.content, req.mode).await?;
        Ok(Response::new(pb::WriteFileResponse { bytes_written: n }))
    }

    async fn read_file(&self, request: Request<pb::ReadFileRequest>) -> Result<Response<pb::ReadFileResponse>, Status> {
        let req = request.into_inner();
        let chunk = self.manager.read_file(&req.sandbox_id, &req.path, req.offset, req.limit).await?;
        Ok(Response::new(pb::ReadFileResponse { content: chunk.content, size: chunk.size, eof: chunk.eof }))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotInfo>, Status> {
        let req = request.into_inner();
        let snap = self.manager.snapshot(&req.sandbox_id, &req.name).await?;
        Ok(Response::new(convert::snapshot(&snap)))
    }

    async fn list_snapshots(&self, request: Request<pb::ListSnapshotsRequest>) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let snaps = self.manager.list_snapshots(&request.into_inner().sandbox_id)?;
        Ok(Response::new(pb::ListSnapshotsResponse { snapshots: snaps.iter().map(convert::snapshot).collect() }))
    }

    async fn rollback(&self, request: Request<pb::RollbackRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let req = request.into_inner();
        let info = self.manager.rollback(&req.sandbox_id, &req.snapshot_id).await?;
        Ok(Response::new(convert::sandbox(&info)))
    }

    async fn delete_snapshot(&self, request: Request<pb::DeleteSnapshotRequest>) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        self.manager.delete_snapshot(&request.into_inner().snapshot_id).await?;
        Ok(Response::new(pb::DeleteSnapshotResponse {}))
    }
}
