//! `sandbox-init`: the process tier's zygote, and so every process-tier sandbox's init (each is
//! a fork of it). The daemon can run that code from its own binary, but each init then faults
//! in page tables over the daemon's ~23 MB of text and shares its relocated data: this binary
//! holds only the init's code, which saves about 40 KiB of page tables per live sandbox.
//! sandboxd runs it when it lies beside the daemon's binary and is of the same build
//! (`sandbox-init --build` prints it); see `zygote::Exe`.

use sandboxd::backend::process::zygote;

fn main() {
    match std::env::args_os().nth(1) {
        Some(a) if a == zygote::ZYGOTE_ARG => zygote::main(),
        Some(a) if a == zygote::BUILD_ARG => println!("{}", zygote::BUILD),
        _ => {
            eprintln!("sandbox-init: started by sandboxd only (`sandbox-init {}` prints its build)", zygote::BUILD_ARG);
            std::process::exit(2);
        }
    }
}
