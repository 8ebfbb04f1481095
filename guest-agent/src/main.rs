//! `sandbox-agent`: PID 1 of a sandboxd microVM (the `/init` of its initramfs).
//!
//! It boots the guest onto the sandbox's disk and then serves the host over a virtio-serial port,
//! forever: see `agent/mod.rs`. Built statically (`+crt-static`) by images/build-vm.sh.

mod agent;

use agent::console::log;

fn main() {
    if std::process::id() != 1 {
        eprintln!("sandbox-agent: this is the init of a sandboxd microVM (images/build-vm.sh puts it in the VM's initramfs); it only runs as PID 1");
        std::process::exit(2);
    }
    // PID 1 must never exit (the kernel panics): a panic anywhere in boot powers the VM off
    // with the reason on the console instead.
    let booted = match std::panic::catch_unwind(agent::boot::boot) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            log!("fatal: {e}");
            agent::boot::halt()
        }
        Err(_) => {
            log!("fatal: panic during boot");
            agent::boot::halt()
        }
    };
    loop {
        let (agent, port) = (booted.agent.clone(), booted.port.clone());
        // `serve` never returns; a panic in the reader starts it again on a fresh session.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || agent::port::serve(agent, &port))).is_err() {
            log!("the request reader panicked; restarting it");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}
