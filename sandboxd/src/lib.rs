//! sandboxd: a daemon that creates and runs sandboxes and serves them over gRPC.
//!
//! Layers, outside in: [`server`] (listeners, health, reflection, shutdown) → [`api`] (protobuf ↔
//! core) → [`manager`] (ids, lifecycle, limits, records) → [`backend`] (one folder per tier).
//! [`model`] holds the plain data they all share, so that the store, metrics, errors and policy
//! need not import the manager or the backends: no module imports in a circle, and no tier
//! reaches into another (`tests/layering.rs` checks both). [`images`] sits below the backends:
//! the catalog they all find images through, imports and builds (which the manager drives).

pub mod admission;
pub mod api;
pub mod audit;
pub mod authority;
pub mod backend;
pub mod config;
pub mod connections;
pub mod drain;
pub mod e2b;
pub mod egress;
pub mod error;
pub mod fleet;
pub mod hostfs;
pub mod ids;
pub mod images;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod mountinfo;
pub mod netpolicy;
pub mod policy;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod web;
