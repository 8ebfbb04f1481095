//! `sandboxd` — the sandbox daemon. See the crate README for flags and the config file.

use clap::Parser;
use sandboxd::backend::process::init;
use sandboxd::config::{Cli, Config, LogFormat};

fn main() -> anyhow::Result<()> {
    // The same binary is each sandbox's init. This check comes before anything else: the init
    // must stay a single-threaded process (it forks), so no runtime may start first.
    if std::env::args_os().nth(1).is_some_and(|a| a == init::INIT_ARG) {
        init::main();
    }
    let cfg = Config::load(Cli::parse())?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    tracing::info!(state_dir = %cfg.state_dir.display(), images_dir = %cfg.images_dir.display(), "sandboxd starting");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(sandboxd::server::run(cfg))
}
