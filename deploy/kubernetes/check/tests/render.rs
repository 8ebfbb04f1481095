//! Renders every overlay of `deploy/kubernetes/` with `kubectl kustomize` and checks what an
//! operator would apply: each document is the typed Kubernetes object of its kind (k8s-openapi,
//! API 1.33) and loses no field on the way (a misspelt or misplaced key would be dropped by the
//! API server without a word); each DaemonSet (one per node pool: one in most overlays, two in
//! `mixed`) mounts what its daemon's config names and what its pool's tiers need (the TLS
//! certificate, key and CA from the Secret `sandboxd-tls`); the probes reach the health service
//! on the daemon's plaintext health listener, not the TLS API port; the Services and the PDB
//! select every pool's pods, the PDB with an integer minAvailable (the only kind a DaemonSet's
//! pods can be evicted under); the config in each ConfigMap loads with the daemon's own loader;
//! and the pools' node selection (nodeSelector and required nodeAffinity, evaluated against
//! sample node labels) puts at most one daemon on any node. Fails, never skips, when `kubectl`
//! is missing or too old.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a test: a failed expectation is a failed test

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, NodeSelectorTerm, PodSpec, Probe, ResourceQuota, Service, Volume};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sandboxd::config::{Cli, Config, ListenAddr, MicroVmAccel};
use sandboxd::model::Isolation;

/// The service name health reports for the API, which a drain turns NOT_SERVING.
const API_HEALTH_SERVICE: &str = "sandbox.v1.SandboxService";
/// The config's file name in the ConfigMap and where the container reads it.
const CONFIG_KEY: &str = "sandboxd.toml";
const CONFIG_PATH: &str = "/etc/sandboxd/sandboxd.toml";
/// The Secret holding the nodes' TLS certificate, key and CA, and its keys (a kubernetes.io/tls
/// Secret's two, and ca.crt as cert-manager writes it).
const TLS_SECRET: &str = "sandboxd-tls";
const TLS_SECRET_KEYS: [&str; 3] = ["tls.crt", "tls.key", "ca.crt"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One DaemonSet of an overlay: a node pool and the tiers its daemons offer.
struct Pool {
    daemonset: &'static str,
    tiers: &'static [Isolation],
    /// The node label (`=true`) the DaemonSet's nodeSelector names, and the only one.
    node_label: &'static str,
    docker_socket: bool,
    kvm: bool,
}

/// A sample node: its labels.
type Node = &'static [(&'static str, &'static str)];

/// What one overlay is for: one fleet (one Namespace, the two Services, one PDB) over its pools.
struct Overlay {
    name: &'static str,
    pools: &'static [Pool],
    /// Sample nodes and the DaemonSet whose daemon runs there (`None`: no sandboxd on it).
    placement: &'static [(Node, Option<&'static str>)],
}

const PROCESS: &str = "sandboxd.dev/tier-process";
const CONTAINER: &str = "sandboxd.dev/tier-container";
const MICROVM: &str = "sandboxd.dev/tier-microvm";

const PROCESS_POOL: Pool = Pool { daemonset: "sandboxd", tiers: &[Isolation::Process], node_label: PROCESS, docker_socket: false, kvm: false };
const CONTAINER_POOL: Pool =
    Pool { daemonset: "sandboxd", tiers: &[Isolation::Process, Isolation::Container], node_label: CONTAINER, docker_socket: true, kvm: false };
const MICROVM_POOL: Pool =
    Pool { daemonset: "sandboxd", tiers: &[Isolation::Process, Isolation::MicroVm], node_label: MICROVM, docker_socket: false, kvm: true };

const OVERLAYS: [Overlay; 4] = [
    Overlay { name: "process", pools: &[PROCESS_POOL], placement: &[(&[(PROCESS, "true")], Some("sandboxd")), (&[(CONTAINER, "true")], None), (&[], None)] },
    Overlay {
        name: "container",
        pools: &[CONTAINER_POOL],
        placement: &[(&[(CONTAINER, "true")], Some("sandboxd")), (&[(PROCESS, "true")], None), (&[], None)],
    },
    Overlay { name: "microvm", pools: &[MICROVM_POOL], placement: &[(&[(MICROVM, "true")], Some("sandboxd")), (&[(PROCESS, "true")], None), (&[], None)] },
    // One fleet, two pools: the container overlay's daemon off the KVM nodes, the microvm
    // overlay's as sandboxd-kvm on them.
    Overlay {
        name: "mixed",
        pools: &[CONTAINER_POOL, Pool { daemonset: "sandboxd-kvm", ..MICROVM_POOL }],
        placement: &[
            (&[(CONTAINER, "true")], Some("sandboxd")),
            (&[(CONTAINER, "true"), (MICROVM, "false")], Some("sandboxd")),
            (&[(MICROVM, "true")], Some("sandboxd-kvm")),
            // Labelled for both: the KVM pool only, never two daemons on one node.
            (&[(CONTAINER, "true"), (MICROVM, "true")], Some("sandboxd-kvm")),
            (&[(PROCESS, "true")], None),
            (&[], None),
        ],
    },
];

/// The documents of one rendered overlay, typed.
#[derive(Default)]
struct Rendered {
    namespaces: Vec<Namespace>,
    daemonsets: Vec<DaemonSet>,
    services: Vec<Service>,
    configmaps: Vec<ConfigMap>,
    pdbs: Vec<PodDisruptionBudget>,
    quotas: Vec<ResourceQuota>,
}

fn kustomize(overlay: &str) -> String {
    let dir = deploy_dir().join("overlays").join(overlay);
    let out = match Command::new("kubectl").arg("kustomize").arg(&dir).output() {
        Ok(out) => out,
        Err(e) => panic!(
            "cannot run `kubectl kustomize` ({e}): install kubectl 1.27 or later (kustomize v5); Debian 12's kubernetes-client (1.20) is too old to render these overlays"
        ),
    };
    assert!(out.status.success(), "kubectl kustomize {} failed: {}", dir.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("kustomize prints UTF-8")
}

/// `value` read as `T`, then written back: any field `T` does not know is lost on the way, and
/// named here.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(value: &serde_yaml::Value, what: &str) -> T {
    let object: T = serde_yaml::from_value(value.clone()).unwrap_or_else(|e| panic!("{what}: not a valid object of its kind: {e}"));
    let back = serde_yaml::to_value(&object).expect("a typed object serializes");
    let mut lost = Vec::new();
    missing(value, &back, what.to_string(), &mut lost);
    assert!(lost.is_empty(), "{what}: fields the Kubernetes API does not know (they would be dropped): {lost:?}");
    object
}

/// The paths of `original` that `back` lacks or holds another scalar at.
fn missing(original: &serde_yaml::Value, back: &serde_yaml::Value, path: String, lost: &mut Vec<String>) {
    use serde_yaml::Value;
    match (original, back) {
        (Value::Mapping(a), Value::Mapping(b)) => {
            for (k, v) in a {
                let key = k.as_str().map(str::to_string).unwrap_or_else(|| format!("{k:?}"));
                match b.get(k) {
                    Some(w) => missing(v, w, format!("{path}.{key}"), lost),
                    None => lost.push(format!("{path}.{key}")),
                }
            }
        }
        (Value::Sequence(a), Value::Sequence(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                missing(v, w, format!("{path}[{i}]"), lost);
            }
        }
        (a, b) if a == b => {}
        // `"9477"` written as a number, or the reverse, is the same value to the API.
        (Value::String(a), Value::Number(b)) | (Value::Number(b), Value::String(a)) if *a == b.to_string() => {}
        (a, b) => lost.push(format!("{path} ({a:?} became {b:?})")),
    }
}

fn render(overlay: &str) -> Rendered {
    let text = kustomize(overlay);
    let mut r = Rendered::default();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{overlay}: document {i} is not YAML: {e}"));
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
        let api = value.get("apiVersion").and_then(|k| k.as_str()).unwrap_or_default().to_string();
        let what = format!("{overlay}: {kind} #{i}");
        match (api.as_str(), kind.as_str()) {
            ("v1", "Namespace") => r.namespaces.push(typed(&value, &what)),
            ("apps/v1", "DaemonSet") => r.daemonsets.push(typed(&value, &what)),
            ("v1", "Service") => r.services.push(typed(&value, &what)),
            ("v1", "ConfigMap") => r.configmaps.push(typed(&value, &what)),
            ("policy/v1", "PodDisruptionBudget") => r.pdbs.push(typed(&value, &what)),
            ("v1", "ResourceQuota") => r.quotas.push(typed(&value, &what)),
            _ => panic!("{what}: apiVersion {api:?} kind {kind:?} is not one this check knows: add it here with its checks"),
        }
    }
    r
}

use serde::Deserialize;

fn volume<'a>(pod: &'a PodSpec, name: &str) -> &'a Volume {
    pod.volumes.iter().flatten().find(|v| v.name == name).unwrap_or_else(|| panic!("no volume {name:?}"))
}

/// The host path mounted at `mount_path` in `c`, with the hostPath type.
fn host_path_at(pod: &PodSpec, c: &Container, mount_path: &str) -> Option<(String, Option<String>)> {
    let m = c.volume_mounts.iter().flatten().find(|m| m.mount_path == mount_path)?;
    let hp = volume(pod, &m.name).host_path.as_ref()?;
    Some((hp.path.clone(), hp.type_.clone()))
}

fn grpc_port(p: &Option<Probe>, which: &str) -> (i32, Option<String>) {
    let grpc = p.as_ref().and_then(|p| p.grpc.as_ref()).unwrap_or_else(|| panic!("{which} is not a gRPC probe"));
    (grpc.port, grpc.service.clone())
}

/// A Service's selector (a plain map): every pair among the labels.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// One requirement of a label selector or a node selector term, as the API server reads it.
fn requirement(key: &str, operator: &str, values: &[String], labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(key);
    match operator {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => !value.is_some_and(|v| values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let bound: i64 = values.first().and_then(|b| b.parse().ok()).unwrap_or_else(|| panic!("{operator} takes one integer: {values:?}"));
            value.and_then(|v| v.parse::<i64>().ok()).is_some_and(|v| if operator == "Gt" { v > bound } else { v < bound })
        }
        other => panic!("selector operator {other:?} is not one this check knows"),
    }
}

/// A DaemonSet's or a PDB's selector: matchLabels and matchExpressions (an empty one would
/// select every pod of the namespace, which none of these may).
fn label_selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let exprs = selector.match_expressions.as_deref().unwrap_or_default();
    let pairs = selector.match_labels.clone().unwrap_or_default();
    (!pairs.is_empty() || !exprs.is_empty())
        && pairs.iter().all(|(k, v)| labels.get(k) == Some(v))
        && exprs.iter().all(|e| requirement(&e.key, &e.operator, e.values.as_deref().unwrap_or_default(), labels))
}

/// The node selector terms the scheduler requires of a node (nodeAffinity's required ones).
fn required_terms(pod: &PodSpec) -> Option<&[NodeSelectorTerm]> {
    let affinity = pod.affinity.as_ref()?.node_affinity.as_ref()?;
    affinity.required_during_scheduling_ignored_during_execution.as_ref().map(|r| r.node_selector_terms.as_slice())
}

/// Whether the scheduler may put `pod` on a node with these labels: its nodeSelector and its
/// required nodeAffinity (terms ORed, a term's expressions ANDed, an empty term matches no node).
/// No taints here: the manifests tolerate none beyond the DaemonSet controller's own.
fn schedules_on(pod: &PodSpec, labels: &BTreeMap<String, String>) -> bool {
    let by_selector = pod.node_selector.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let by_affinity = required_terms(pod).is_none_or(|terms| {
        terms.iter().any(|t| {
            assert!(t.match_fields.as_ref().is_none_or(Vec::is_empty), "nodeAffinity matchFields: not evaluated by this check");
            let exprs = t.match_expressions.as_deref().unwrap_or_default();
            !exprs.is_empty() && exprs.iter().all(|e| requirement(&e.key, &e.operator, e.values.as_deref().unwrap_or_default(), labels))
        })
    });
    by_selector && by_affinity
}

/// Every node label key the pod's node selection names, with each value it names.
fn node_label_values(pod: &PodSpec) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = pod.node_selector.iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect();
    for e in required_terms(pod).unwrap_or_default().iter().flat_map(|t| t.match_expressions.iter().flatten()) {
        out.extend(e.values.iter().flatten().map(|v| (e.key.clone(), v.clone())));
    }
    out
}

/// The files of Secrets the config names, as written in it: the loader reads stand-ins instead.
struct SecretFiles {
    token_file: String,
    tls_ca_file: Option<String>,
}

/// Loads the ConfigMap's config with the daemon's loader, as the pod on node `kube_node` would
/// (the fleet token and the peers' CA read from stand-ins of the Secrets' files; `[tls]`'s
/// certificate and key are read when the daemon starts serving, not by the loader).
fn load_config(text: &str, kube_node: &str) -> (Config, SecretFiles) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut file: toml::Table = toml::from_str(text).expect("the ConfigMap's config is TOML");
    let fleet = file.get_mut("fleet").and_then(|f| f.as_table_mut()).expect("a [fleet] table");
    let token_file = fleet.get("token_file").and_then(|t| t.as_str()).expect("fleet.token_file").to_string();
    let token = dir.path().join("token");
    std::fs::write(&token, "a-fleet-token-of-32-characters-x").expect("write token");
    fleet.insert("token_file".into(), token.display().to_string().into());
    let tls_ca_file = fleet.get("tls_ca_file").and_then(|t| t.as_str()).map(str::to_string);
    if tls_ca_file.is_some() {
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").expect("write CA");
        fleet.insert("tls_ca_file".into(), ca.display().to_string().into());
    }
    let path = dir.path().join(CONFIG_KEY);
    std::fs::write(&path, toml::to_string(&file).expect("serialize")).expect("write config");
    // What the DaemonSet's env gives the daemon (checked against it by the caller).
    // One test function sets these, before anything reads them.
    std::env::set_var("SANDBOXD_KUBE_NODE_NAME", kube_node);
    std::env::set_var("SANDBOXD_NODE_ADDRESS", "10.244.1.7:7070");
    std::env::remove_var("SANDBOXD_NODE_NAME");
    let cfg = Config::load(Cli { config: Some(path), ..Default::default() }).unwrap_or_else(|e| panic!("the daemon refuses the ConfigMap's config: {e}"));
    (cfg, SecretFiles { token_file, tls_ca_file })
}

#[test]
fn every_overlay_renders_to_typed_objects_that_fit_the_daemon() {
    let mut dirs: Vec<String> = std::fs::read_dir(deploy_dir().join("overlays"))
        .expect("deploy/kubernetes/overlays")
        .map(|e| e.expect("a directory entry").file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut known: Vec<&str> = OVERLAYS.iter().map(|o| o.name).collect();
    known.sort_unstable();
    assert_eq!(dirs, known, "every overlay is one this check renders (add a new one to OVERLAYS)");
    for o in &OVERLAYS {
        check(o);
    }
}

/// One overlay: one fleet of one or more DaemonSets (pools), each checked against its config,
/// then what makes them one fleet and keeps them apart.
fn check(o: &Overlay) {
    let r = render(o.name);
    let ctx = o.name;
    assert_eq!(r.namespaces.len(), 1, "{ctx}: one Namespace");
    let namespace = r.namespaces[0].metadata.name.clone().expect("namespace name");
    assert_eq!(r.daemonsets.len(), o.pools.len(), "{ctx}: one DaemonSet per node pool");
    assert_eq!(r.configmaps.len(), o.pools.len(), "{ctx}: one ConfigMap per node pool");
    assert_eq!(r.services.len(), 2, "{ctx}: two Services, the fleet's");
    assert_eq!(r.pdbs.len(), 1, "{ctx}: one PodDisruptionBudget, the fleet's");

    let daemonsets: Vec<&DaemonSet> = o
        .pools
        .iter()
        .map(|pool| {
            let ds = r
                .daemonsets
                .iter()
                .find(|d| d.metadata.name.as_deref() == Some(pool.daemonset))
                .unwrap_or_else(|| panic!("{ctx}: a DaemonSet named {}", pool.daemonset));
            check_daemon(&format!("{ctx} {}", pool.daemonset), pool, ds, &r, &namespace);
            ds
        })
        .collect();

    // One fleet, its pools apart: each ConfigMap is one pool's; no DaemonSet counts another's
    // pods as its own; all run the same image.
    let spec = |ds: &DaemonSet| ds.spec.clone().expect("DaemonSet spec");
    let pod = |ds: &DaemonSet| spec(ds).template.spec.expect("pod spec");
    for cm in &r.configmaps {
        let name = cm.metadata.name.clone().expect("ConfigMap name");
        let users = daemonsets.iter().filter(|ds| pod(ds).volumes.iter().flatten().any(|v| v.config_map.as_ref().is_some_and(|c| c.name == name))).count();
        assert_eq!(users, 1, "{ctx}: ConfigMap {name} is the config of exactly one DaemonSet");
    }
    for a in &daemonsets {
        for b in &daemonsets {
            if a.metadata.name != b.metadata.name {
                let b_labels = spec(b).template.metadata.and_then(|m| m.labels).unwrap_or_default();
                assert!(
                    !label_selector_matches(&spec(a).selector, &b_labels),
                    "{ctx}: DaemonSet {:?}'s selector also matches {:?}'s pods",
                    a.metadata.name,
                    b.metadata.name
                );
            }
        }
    }
    let images: Vec<Option<String>> =
        daemonsets.iter().map(|ds| pod(ds).containers.iter().find(|c| c.name == "sandboxd").and_then(|c| c.image.clone())).collect();
    assert!(images.windows(2).all(|w| w[0] == w[1]), "{ctx}: one image for the whole fleet: {images:?}");

    // The nodes: each sample node runs the DaemonSet the overlay says, and no node (every mix
    // of the labels and values the DaemonSets name, or their absence) runs two.
    let on = |labels: &BTreeMap<String, String>| -> Vec<String> {
        daemonsets.iter().filter(|ds| schedules_on(&pod(ds), labels)).map(|ds| ds.metadata.name.clone().unwrap_or_default()).collect()
    };
    for (node, expected) in o.placement {
        let labels: BTreeMap<String, String> = node.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(on(&labels), expected.iter().map(|e| e.to_string()).collect::<Vec<_>>(), "{ctx}: the daemons on a node labelled {labels:?}");
    }
    let mut values: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for ds in &daemonsets {
        for (key, value) in node_label_values(&pod(ds)) {
            let v = values.entry(key).or_insert_with(|| vec![None, Some("some-other-value".into())]);
            if !v.contains(&Some(value.clone())) {
                v.push(Some(value));
            }
        }
    }
    let mut nodes = vec![BTreeMap::new()];
    for (key, vs) in &values {
        nodes = nodes
            .iter()
            .flat_map(|n: &BTreeMap<String, String>| {
                vs.iter().map(move |v| {
                    let mut n = n.clone();
                    if let Some(v) = v {
                        n.insert(key.clone(), v.clone());
                    }
                    n
                })
            })
            .collect();
    }
    for labels in &nodes {
        let daemons = on(labels);
        assert!(daemons.len() <= 1, "{ctx}: a node labelled {labels:?} would run {daemons:?}: the pools' node selection overlaps");
    }
}

/// One DaemonSet of the overlay: its pods, its config and the fleet's Services and PDB.
fn check_daemon(ctx: &str, pool: &Pool, ds: &DaemonSet, r: &Rendered, namespace: &str) {
    assert_eq!(ds.metadata.namespace.as_deref(), Some(namespace), "{ctx}: the DaemonSet is in the namespace");
    let spec = ds.spec.as_ref().expect("DaemonSet spec");
    let template_labels = spec.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
    assert!(label_selector_matches(&spec.selector, &template_labels), "{ctx}: the DaemonSet's selector matches its pods");
    let pod = spec.template.spec.as_ref().expect("pod spec");
    let annotations = spec.template.metadata.as_ref().and_then(|m| m.annotations.clone()).unwrap_or_default();

    // Nodes: the pool's label, and only it (the overlay's placement table checks the rest).
    let selector = pod.node_selector.clone().unwrap_or_default();
    assert_eq!(selector.get(pool.node_label).map(String::as_str), Some("true"), "{ctx}: node selector {selector:?}");
    assert_eq!(selector.len(), 1, "{ctx}: only the pool's label selects nodes by nodeSelector: {selector:?}");

    let c = pod.containers.iter().find(|c| c.name == "sandboxd").expect("a container named sandboxd");
    let privileged = c.security_context.as_ref().and_then(|s| s.privileged);
    assert_eq!(privileged, Some(true), "{ctx}: the daemon runs privileged");
    assert!(
        c.resources.as_ref().and_then(|r| r.requests.as_ref()).is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
        "{ctx}: resource requests"
    );

    // The config: from the generated ConfigMap, loaded by the daemon's own loader.
    let config_mount = c.volume_mounts.iter().flatten().find(|m| m.mount_path == CONFIG_PATH).expect("the config is mounted");
    assert_eq!(config_mount.sub_path.as_deref(), Some(CONFIG_KEY), "{ctx}");
    let cm_name = volume(pod, &config_mount.name).config_map.as_ref().map(|v| v.name.clone()).expect("the config from a ConfigMap");
    let cm = r.configmaps.iter().find(|m| m.metadata.name.as_deref() == Some(cm_name.as_str()));
    let cm = cm.unwrap_or_else(|| panic!("{ctx}: the mounted ConfigMap {cm_name} is a rendered one"));
    assert_eq!(c.args.clone().unwrap_or_default(), ["--config", CONFIG_PATH], "{ctx}: the daemon reads it");
    let text = cm.data.as_ref().and_then(|d| d.get(CONFIG_KEY)).expect("the ConfigMap holds sandboxd.toml");
    let (cfg, secret_files) = load_config(text, "ip-10-0-1-23.eu-west-1.compute.internal");
    let token_file = secret_files.token_file.clone();
    for tier in Isolation::ALL {
        assert_eq!(cfg.policy.allows(tier), pool.tiers.contains(&tier), "{ctx}: policy.allowed for {tier:?}");
    }
    assert!(
        cfg.auth.tokens.iter().all(|t| t.sha256.bytes().all(|b| b == b'0')),
        "{ctx}: the shipped config lets no token in until the operator sets the tenants'"
    );
    if pool.kvm {
        assert_eq!(cfg.microvm.accel, MicroVmAccel::Kvm, "{ctx}: microVMs under KVM only");
    }

    // The env the fleet config relies on.
    let env: BTreeMap<String, (Option<String>, Option<String>)> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), (e.value.clone(), e.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.clone()))))
        .collect();
    assert_eq!(env.get("SANDBOXD_KUBE_NODE_NAME").and_then(|e| e.1.clone()).as_deref(), Some("spec.nodeName"), "{ctx}: node name from the node");
    assert_eq!(env.get("POD_IP").and_then(|e| e.1.clone()).as_deref(), Some("status.podIP"), "{ctx}");
    let fleet = cfg.fleet.as_ref().expect("[fleet]");
    assert_eq!(fleet.node.as_str(), "ip-10-0-1-23", "{ctx}: a dotted Kubernetes node name becomes a fleet node name");
    assert_eq!(env.get("SANDBOXD_NODE_ADDRESS").and_then(|e| e.0.clone()), Some(format!("$(POD_IP):{}", fleet.port)), "{ctx}: the node's address");

    // Listeners and ports: TCP on the fleet port, the UNIX socket for the drain in a mounted dir.
    let tcp = cfg
        .listen
        .iter()
        .find_map(|l| match l {
            ListenAddr::Tcp(a) => Some(*a),
            _ => None,
        })
        .expect("a TCP listener");
    assert!(tcp.ip().is_unspecified(), "{ctx}: the TCP listener takes the pod IP ({tcp})");
    assert_eq!(tcp.port(), fleet.port, "{ctx}: peers call the port the daemon listens on");
    let container_port = c.ports.iter().flatten().find(|p| p.name.as_deref() == Some("grpc")).expect("a port named grpc").container_port;
    assert_eq!(container_port as u16, tcp.port(), "{ctx}: containerPort grpc");
    let metrics = cfg.metrics.expect("metrics served");
    assert_eq!(annotations.get("prometheus.io/port").cloned(), Some(metrics.port().to_string()), "{ctx}: scrape annotations name the metrics port");
    assert_eq!(annotations.get("prometheus.io/scrape").map(String::as_str), Some("true"), "{ctx}");
    assert_eq!(annotations.get("prometheus.io/path").map(String::as_str), Some("/metrics"), "{ctx}");

    // Probes: the health service on the health listener (plaintext, health only), since the
    // API's TCP listener serves TLS, which the kubelet's gRPC probes cannot speak; readiness is
    // the API's own status.
    let health = cfg.health_listen.unwrap_or_else(|| panic!("{ctx}: health_listen: the probes' plaintext port"));
    assert!(health.ip().is_unspecified(), "{ctx}: the health listener takes the pod IP, where the kubelet probes ({health})");
    assert_ne!(health.port(), tcp.port(), "{ctx}: the probes' port is not the API's (TLS)");
    let health_port = c.ports.iter().flatten().find(|p| p.name.as_deref() == Some("health")).expect("a port named health").container_port;
    assert_eq!(health_port as u16, health.port(), "{ctx}: containerPort health is health_listen's");
    for (probe, which) in [(&c.readiness_probe, "readiness"), (&c.liveness_probe, "liveness"), (&c.startup_probe, "startup")] {
        assert_eq!(grpc_port(probe, which).0 as u16, health.port(), "{ctx}: the {which} probe reaches the health listener's port (health_listen)");
    }
    assert_eq!(grpc_port(&c.readiness_probe, "readiness").1.as_deref(), Some(API_HEALTH_SERVICE), "{ctx}: readiness turns off with a drain");
    assert_eq!(grpc_port(&c.liveness_probe, "liveness").1.filter(|s| !s.is_empty()), None, "{ctx}: liveness asks the overall status, which a drain leaves on");

    // The preStop drain: through the config's UNIX socket, within the grace period.
    let pre_stop =
        c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()).and_then(|h| h.exec.as_ref()).and_then(|e| e.command.clone()).expect("a preStop exec hook");
    assert_eq!(pre_stop.first().map(String::as_str), Some("sandboxd"), "{ctx}: {pre_stop:?}");
    let arg = |flag: &str| pre_stop.iter().position(|a| a == flag).and_then(|i| pre_stop.get(i + 1)).cloned();
    assert!(pre_stop.iter().any(|a| a == "drain"), "{ctx}: {pre_stop:?}");
    assert_eq!(arg("--config").as_deref(), Some(CONFIG_PATH), "{ctx}: the drain finds the socket in the same config");
    let secs = |flag: &str| arg(flag).and_then(|v| v.parse::<i64>().ok()).unwrap_or_else(|| panic!("{ctx}: preStop {flag} N"));
    let grace = pod.termination_grace_period_seconds.expect("terminationGracePeriodSeconds");
    assert!(grace > secs("--timeout") + secs("--stop-timeout"), "{ctx}: grace {grace} s leaves the drain its deadline and the SIGTERM shutdown");
    let socket = cfg
        .listen
        .iter()
        .find_map(|l| match l {
            ListenAddr::Unix(p) => Some(p.clone()),
            _ => None,
        })
        .expect("a UNIX listener for the drain");
    let socket_dir = socket.parent().expect("socket dir").display().to_string();
    assert!(c.volume_mounts.iter().flatten().any(|m| m.mount_path == socket_dir), "{ctx}: {socket_dir} is a volume of its own");

    // What the tiers need from the node, at the paths the config names.
    let state = cfg.state_dir.display().to_string();
    let (path, _) = host_path_at(pod, c, &state).unwrap_or_else(|| panic!("{ctx}: the state dir {state} is a hostPath"));
    assert_eq!(path, state, "{ctx}: the state dir is the same path on the node (Docker binds paths under it)");
    let propagation = c.volume_mounts.iter().flatten().find(|m| m.mount_path == state).and_then(|m| m.mount_propagation.clone());
    assert_eq!(propagation.as_deref(), Some("Bidirectional"), "{ctx}: the daemon's mounts under the state dir reach the host");
    let images = cfg.images_dir.display().to_string();
    assert_eq!(host_path_at(pod, c, &images).map(|h| h.0), Some(images.clone()), "{ctx}: the images dir is on the node at the same path");
    assert_eq!(host_path_at(pod, c, "/sys/fs/cgroup").map(|h| h.0).as_deref(), Some("/sys/fs/cgroup"), "{ctx}: the host's cgroup fs");
    assert_eq!(host_path_at(pod, c, "/dev").map(|h| h.0).as_deref(), Some("/dev"), "{ctx}: the host's /dev (loop devices)");
    let token_dir = Path::new(&token_file).parent().expect("token dir").display().to_string();
    let token_mount = c.volume_mounts.iter().flatten().find(|m| m.mount_path == token_dir).unwrap_or_else(|| panic!("{ctx}: {token_dir} is mounted"));
    let secret = volume(pod, &token_mount.name).secret.as_ref().expect("the fleet token from a Secret");
    assert_eq!(secret.secret_name.as_deref(), Some("sandboxd-fleet"), "{ctx}");
    assert_eq!(Path::new(&token_file).file_name().and_then(|f| f.to_str()), Some("token"), "{ctx}: the Secret's key is `token`");

    // TLS: the TCP listener's certificate and key and the peers' CA are the keys of the Secret
    // sandboxd-tls, mounted read-only, and the peers check the headless Service's name (below).
    let tls = cfg.tls.as_ref().unwrap_or_else(|| panic!("{ctx}: [tls]: the API's TCP listener serves TLS"));
    let tls_ca_file = secret_files.tls_ca_file.clone().unwrap_or_else(|| panic!("{ctx}: fleet.tls_ca_file"));
    let tls_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| {
            m.sub_path.is_none()
                && pod.volumes.iter().flatten().any(|v| v.name == m.name && v.secret.as_ref().is_some_and(|s| s.secret_name.as_deref() == Some(TLS_SECRET)))
        })
        .unwrap_or_else(|| panic!("{ctx}: the Secret {TLS_SECRET} is mounted (a directory, not a subPath, so a renewed certificate reaches the pod)"));
    assert_eq!(tls_mount.read_only, Some(true), "{ctx}: the Secret {TLS_SECRET} is mounted read-only");
    let tls_secret = volume(pod, &tls_mount.name).secret.as_ref().expect("a Secret volume");
    assert!(tls_secret.items.is_none(), "{ctx}: the Secret's keys are its file names (no items remap them)");
    for (path, key, what) in [
        (tls.cert.clone(), TLS_SECRET_KEYS[0], "tls.cert"),
        (tls.key.clone(), TLS_SECRET_KEYS[1], "tls.key"),
        (PathBuf::from(&tls_ca_file), TLS_SECRET_KEYS[2], "fleet.tls_ca_file"),
    ] {
        assert_eq!(
            path,
            Path::new(&tls_mount.mount_path).join(key),
            "{ctx}: {what} is the key {key} of the Secret {TLS_SECRET}, mounted at {}",
            tls_mount.mount_path
        );
    }

    let docker = host_path_at(pod, c, "/var/run/docker.sock");
    assert_eq!(docker.is_some(), pool.docker_socket, "{ctx}: the Docker Engine's socket only where the container tier runs");
    if pool.docker_socket {
        assert_eq!(docker, Some(("/var/run/docker.sock".into(), Some("Socket".into()))), "{ctx}");
        assert_eq!(pod.host_pid, Some(true), "{ctx}: the container tier waits on containers' host pids");
    } else {
        assert_ne!(pod.host_pid, Some(true), "{ctx}: no host pids without the container tier");
    }
    let kvm = host_path_at(pod, c, "/dev/kvm");
    assert_eq!(kvm.is_some(), pool.kvm, "{ctx}: /dev/kvm only where the microVM tier runs");
    if pool.kvm {
        assert_eq!(kvm, Some(("/dev/kvm".into(), Some("CharDevice".into()))), "{ctx}: a node without KVM fails the pod's start");
    }

    // The Services: the peers' headless one (the name fleet.peers_dns resolves), and the clients'.
    for s in &r.services {
        let name = s.metadata.name.clone().unwrap_or_default();
        let spec = s.spec.as_ref().expect("Service spec");
        assert!(selects(&spec.selector.clone().unwrap_or_default(), &template_labels), "{ctx}: Service {name} selects the daemon's pods");
        let port = spec.ports.iter().flatten().next().expect("a port");
        assert_eq!(port.port as u16, tcp.port(), "{ctx}: Service {name} port");
        assert_eq!(port.target_port, Some(IntOrString::String("grpc".into())), "{ctx}: Service {name} targets the grpc port");
    }
    let headless = r.services.iter().find(|s| s.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()) == Some("None")).expect("a headless Service");
    let headless_name = headless.metadata.name.clone().expect("name");
    assert_eq!(fleet.peers_dns, format!("{headless_name}.{namespace}.svc.cluster.local"), "{ctx}: fleet.peers_dns is the headless Service's name");
    let peer_tls = fleet.tls.as_ref().unwrap_or_else(|| panic!("{ctx}: the peers call one another over TLS"));
    assert_eq!(peer_tls.server_name, fleet.peers_dns, "{ctx}: fleet.tls_server_name is the headless Service's name, which the nodes' certificate carries");
    assert_eq!(headless.spec.as_ref().and_then(|s| s.publish_not_ready_addresses), Some(true), "{ctx}: a draining node stays reachable to its peers");
    let front = r.services.iter().find(|s| s.metadata.name != headless.metadata.name).expect("the clients' Service");
    assert_eq!(front.spec.as_ref().and_then(|s| s.type_.as_deref()), Some("ClusterIP"), "{ctx}");
    assert_ne!(front.spec.as_ref().and_then(|s| s.publish_not_ready_addresses), Some(true), "{ctx}: clients reach ready daemons only");

    // The daemon's priority class, and the quota some clusters need to admit it outside
    // kube-system.
    let priority = pod.priority_class_name.clone().expect("a priority class");
    let scoped =
        r.quotas.iter().any(|q| {
            q.metadata.namespace.as_deref() == Some(namespace)
                && q.spec.as_ref().and_then(|s| s.scope_selector.as_ref()).and_then(|s| s.match_expressions.as_ref()).is_some_and(|m| {
                    m.iter().any(|e| e.scope_name == "PriorityClass" && e.operator == "In" && e.values.iter().flatten().any(|v| *v == priority))
                })
        });
    assert!(scoped, "{ctx}: a ResourceQuota in the namespace is scoped to priority class {priority}");

    let pdb = r.pdbs[0].spec.as_ref().expect("PDB spec");
    assert!(pdb.selector.as_ref().is_some_and(|s| label_selector_matches(s, &template_labels)), "{ctx}: the PodDisruptionBudget covers the daemon's pods");
    // A DaemonSet has no scale: the disruption controller can compute maxUnavailable or a
    // percentage only from an owner's scale, and allows no eviction at all without one.
    assert_eq!(pdb.max_unavailable, None, "{ctx}: no maxUnavailable in the PDB of a DaemonSet's pods (no eviction would ever be allowed)");
    assert!(
        matches!(pdb.min_available, Some(IntOrString::Int(n)) if n >= 1),
        "{ctx}: the PDB's minAvailable is an integer of at least 1 (not a percentage): {:?}",
        pdb.min_available
    );
}
