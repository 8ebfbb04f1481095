//! `sandboxd` — the sandbox daemon. See the crate README for flags and the config file.

use clap::Parser;
use sandboxd::backend::process::zygote;
use sandboxd::config::{Cli, Command, Config, DrainArgs, LogFormat};
use sandboxd::telemetry::Telemetry;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

fn main() -> anyhow::Result<()> {
    // The same binary is the zygote that clones each sandbox's init. This check comes before
    // anything else: the zygote must stay a single-threaded process (it forks), so no runtime
    // may start first.
    if std::env::args_os().nth(1).is_some_and(|a| a == zygote::ZYGOTE_ARG) {
        zygote::main();
    }
    // And the guard each microVM's QEMU runs under (it forks too).
    if std::env::args_os().nth(1).is_some_and(|a| a == sandboxd::backend::microvm::guard::GUARD_ARG) {
        sandboxd::backend::microvm::guard::main();
    }
    // Descriptors inherited from whoever started the daemon (`sandboxd 9>>/some/file`) must
    // never reach anything it starts: mark them all close-on-exec before any thread exists.
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors; it closes
    // nothing and no Rust object is invalidated.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    let mut cli = Cli::parse();
    if let Some(Command::Drain(args)) = cli.command.take() {
        return drain(&args, cli.config.as_deref());
    }
    let cfg = Config::load(cli)?;
    // Every running exec holds descriptors; the usual soft limit of 1024 would let a few hundred
    // of them starve every other call. Logged below, once logging is up.
    let nofile = sandboxd::admission::raise_nofile_limit();
    // The daemon serves every tenant: under memory pressure the kernel must kill a sandbox's
    // processes (reset to 0 in each child it starts) before it.
    let oom = sandboxd::admission::set_oom_score_adj(cfg.admission.oom_score_adj);
    sandboxd::admission::set_sandbox_oom_score_adj(cfg.admission.sandbox_oom_score_adj);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    // The OTLP exporter's gRPC channel is a task on the runtime, so it is built inside it, and
    // the runtime lives until the exporter has flushed (below).
    let telemetry = {
        let _entered = runtime.enter();
        Telemetry::start(&cfg.telemetry)?
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal: a pipe, a file or journald gets plain text.
    let log = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let log = match cfg.log_format {
        LogFormat::Json => log.json().boxed(),
        LogFormat::Text => log.boxed(),
    };
    tracing_subscriber::registry().with(filter).with(log).with(telemetry.as_ref().map(Telemetry::layer)).init();
    tracing::info!(state_dir = %cfg.state_dir.display(), images_dir = %cfg.images_dir.display(), "sandboxd starting");
    log_nofile(&cfg, nofile);
    match oom {
        Ok(()) => tracing::info!(
            oom_score_adj = cfg.admission.oom_score_adj,
            sandbox_oom_score_adj = cfg.admission.sandbox_oom_score_adj,
            "the kernel's OOM killer takes sandboxes before the daemon"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            sandbox_oom_score_adj = cfg.admission.sandbox_oom_score_adj,
            "cannot lower the daemon's oom_score_adj (no CAP_SYS_RESOURCE?): only the sandboxes' higher oom_score_adj keeps the daemon from being the OOM killer's first choice"
        ),
    }
    if let Some(endpoint) = &cfg.telemetry.otlp_endpoint {
        tracing::info!(%endpoint, service_name = %cfg.telemetry.service_name, "exporting traces over OTLP/gRPC");
    }
    let result = runtime.block_on(sandboxd::server::run(cfg));
    // After the listeners have drained, so the spans of the last RPCs are in the final batch.
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    result
}

/// `sandboxd drain`: plain log lines on stderr (a preStop hook's output lands in the kubelet's
/// events when it fails).
fn drain(args: &DrainArgs, config: Option<&std::path::Path>) -> anyhow::Result<()> {
    use anyhow::Context;
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).init();
    let socket = args.socket_path(config)?;
    let deadline = std::time::Duration::from_secs(args.timeout);
    let outcome = sandboxd::drain::drain(&socket, deadline, std::time::Duration::from_secs(args.stop_timeout))
        .with_context(|| format!("draining the daemon on {}", socket.display()))?;
    match outcome {
        sandboxd::drain::Drained::Quiet { pid, after } => {
            tracing::info!(pid, secs = after.as_secs_f64(), "drained: every exec ended and the daemon exited")
        }
        sandboxd::drain::Drained::Stopped { pid, after } => tracing::warn!(
            pid,
            secs = after.as_secs_f64(),
            timeout = args.timeout,
            "execs were still running at the deadline: the daemon was stopped with SIGTERM (its sandboxes are kept for the next start)"
        ),
    }
    Ok(())
}

/// Logs the open-file limit the daemon runs with and how many execs it leaves room for, warning
/// when a configured exec cap is above that.
fn log_nofile(cfg: &Config, nofile: Result<sandboxd::admission::NofileLimit, String>) {
    let limit = match nofile {
        Ok(l) => l,
        Err(e) => return tracing::warn!(error = %e, "cannot raise the open-file limit; execs may fail with \"Too many open files\" under load"),
    };
    let budget = limit.exec_budget();
    tracing::info!(
        soft = limit.soft,
        hard = limit.hard,
        previous_soft = limit.previous_soft,
        exec_budget = budget,
        "open-file limit raised to the hard limit: descriptors for about {budget} running execs"
    );
    let caps = cfg.policy.exec_caps();
    for (key, cap) in
        [("policy.max_concurrent_execs", cfg.policy.max_concurrent_execs()), ("policy.max_running_execs_per_tenant", Some(caps.running_per_tenant))]
    {
        if let Some(cap) = cap.filter(|&c| c as u64 > budget) {
            tracing::warn!(
                key,
                cap,
                exec_budget = budget,
                "an exec cap is above what the open-file limit leaves room for: lower it or raise the hard RLIMIT_NOFILE"
            );
        }
    }
}
