//! The seccomp filter every process in a process-tier sandbox runs under.
//!
//! A deny list (default allow), because the goal is "an ordinary Linux userland works, the kernel
//! interfaces a sandbox has no business with do not": mounting, namespaces, kernel modules,
//! kexec, BPF, the keyring, perf, io_uring, reaching into other processes, clock changes, swap,
//! reboot ([`DENIED_FAMILIES`]). Most of these also need a
//! capability the sandbox no longer has; the filter is the second wall, and it covers the calls
//! that need none (`unshare(CLONE_NEWUSER)`, `keyctl`, `userfaultfd`, `perf_event_open`).
//!
//! `ptrace` stays allowed: the pid namespace means only the sandbox's own processes can be traced
//! (strace and gdb inside a sandbox are legitimate), outside pids cannot even be named, and the
//! sandbox's init is non-dumpable, so it cannot be traced either.
//! `clone3` answers ENOSYS so libc falls back to `clone`, whose flags a filter can inspect (clone3
//! passes them in memory, out of seccomp's reach).

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch};

/// Errors building or installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter: {0}")]
    Build(String),
    #[error("installing the seccomp filter: {0}")]
    Install(String),
}

/// A syscall by its libc constant's name (`SYS_mount`) and number.
macro_rules! sys {
    ($name:ident) => {
        (stringify!($name), libc::$name)
    };
}

/// Syscalls denied outright with EPERM, by family: the single list for the process tier (the
/// container tier runs under Docker's default profile, the microVM tier behind a guest kernel).
/// At least as strict as Docker's default profile for a container without added capabilities;
/// each family has a test below that fails when any of its calls gets through.
pub const DENIED_FAMILIES: &[(&str, &[(&str, i64)])] = &[
    (
        "mount",
        &[
            sys!(SYS_mount),
            sys!(SYS_umount2),
            sys!(SYS_pivot_root),
            sys!(SYS_move_mount),
            sys!(SYS_open_tree),
            sys!(SYS_fsopen),
            sys!(SYS_fsconfig),
            sys!(SYS_fsmount),
            sys!(SYS_fspick),
            sys!(SYS_mount_setattr),
        ],
    ),
    ("namespaces", &[sys!(SYS_unshare), sys!(SYS_setns)]),
    ("kernel modules and kexec", &[sys!(SYS_init_module), sys!(SYS_finit_module), sys!(SYS_delete_module), sys!(SYS_kexec_load), sys!(SYS_kexec_file_load)]),
    ("bpf", &[sys!(SYS_bpf)]),
    ("keyring", &[sys!(SYS_keyctl), sys!(SYS_add_key), sys!(SYS_request_key)]),
    ("perf and tracing", &[sys!(SYS_perf_event_open), sys!(SYS_lookup_dcookie), sys!(SYS_fanotify_init)]),
    ("userfaultfd", &[sys!(SYS_userfaultfd)]),
    // A large kernel surface that bypasses seccomp for the operations it queues (Docker denies
    // it since 25.0).
    ("io_uring", &[sys!(SYS_io_uring_setup), sys!(SYS_io_uring_enter), sys!(SYS_io_uring_register)]),
    // Reaching into other processes' memory and descriptors: Docker allows these only with
    // CAP_SYS_PTRACE. ptrace itself stays (strace, gdb); the init is non-dumpable.
    ("process inspection", &[sys!(SYS_process_vm_readv), sys!(SYS_process_vm_writev), sys!(SYS_kcmp), sys!(SYS_pidfd_getfd)]),
    ("file handles", &[sys!(SYS_open_by_handle_at), sys!(SYS_name_to_handle_at)]),
    ("clock", &[sys!(SYS_settimeofday), sys!(SYS_clock_settime), sys!(SYS_clock_adjtime), sys!(SYS_adjtimex)]),
    (
        "system administration",
        &[
            sys!(SYS_reboot),
            sys!(SYS_swapon),
            sys!(SYS_swapoff),
            sys!(SYS_acct),
            sys!(SYS_syslog),
            sys!(SYS_quotactl),
            sys!(SYS_iopl),
            sys!(SYS_ioperm),
            sys!(SYS_vhangup),
            sys!(SYS_uselib),
            sys!(SYS__sysctl),
            sys!(SYS_nfsservctl),
        ],
    ),
    ("numa placement", &[sys!(SYS_mbind), sys!(SYS_set_mempolicy), sys!(SYS_migrate_pages), sys!(SYS_move_pages)]),
];

/// Socket address families a sandbox has no use for, denied with EPERM at `socket(2)`: the single
/// list for both tiers that share the host kernel. Docker's default profile denies `AF_VSOCK`
/// (vsock is not network-namespaced: a sandbox could reach the host's and other guests' vsock
/// services); the others are protocol families of old or special hardware whose kernel code has
/// a long CVE record and that an ordinary userland never opens. Left allowed: `AF_UNIX`,
/// `AF_INET`, `AF_INET6`, `AF_NETLINK` (ip, ss, glibc's getaddrinfo), `AF_PACKET` (needs
/// CAP_NET_RAW, which a sandbox does not have) and `AF_ALG` (the kernel crypto API, used by some
/// crypto libraries). Each family has a test below.
pub const DENIED_SOCKET_FAMILIES: &[(&str, i32)] = &[
    ("AF_VSOCK", libc::AF_VSOCK),
    ("AF_KEY", libc::AF_KEY),
    ("AF_AX25", libc::AF_AX25),
    ("AF_IPX", libc::AF_IPX),
    ("AF_APPLETALK", libc::AF_APPLETALK),
    ("AF_NETROM", libc::AF_NETROM),
    ("AF_ATMPVC", libc::AF_ATMPVC),
    ("AF_X25", libc::AF_X25),
    ("AF_ROSE", libc::AF_ROSE),
    ("AF_DECnet", libc::AF_DECnet),
    ("AF_ATMSVC", libc::AF_ATMSVC),
    ("AF_RDS", libc::AF_RDS),
    ("AF_IRDA", libc::AF_IRDA),
    ("AF_PPPOX", libc::AF_PPPOX),
    ("AF_LLC", libc::AF_LLC),
    ("AF_IB", libc::AF_IB),
    ("AF_MPLS", libc::AF_MPLS),
    ("AF_CAN", libc::AF_CAN),
    ("AF_TIPC", libc::AF_TIPC),
    ("AF_BLUETOOTH", libc::AF_BLUETOOTH),
    ("AF_IUCV", libc::AF_IUCV),
    ("AF_RXRPC", libc::AF_RXRPC),
    ("AF_ISDN", libc::AF_ISDN),
    ("AF_PHONET", libc::AF_PHONET),
    ("AF_IEEE802154", libc::AF_IEEE802154),
    ("AF_CAIF", libc::AF_CAIF),
    ("AF_NFC", libc::AF_NFC),
    ("AF_KCM", 41),
    ("AF_QIPCRTR", 42),
    ("AF_SMC", 43),
    ("AF_XDP", libc::AF_XDP),
    ("AF_MCTP", 45),
];

/// The `personality(2)` values Docker's default profile allows: `PER_LINUX`, `PER_LINUX32`,
/// `UNAME26`, `PER_LINUX32 | UNAME26` and the query `0xffffffff`. The other flags switch off
/// hardening for the caller and its children (`ADDR_NO_RANDOMIZE` turns ASLR off,
/// `READ_IMPLIES_EXEC` makes every readable mapping executable, `MMAP_PAGE_ZERO` maps page 0):
/// refused with EPERM on both tiers that share the host kernel, as Docker refuses them.
pub const ALLOWED_PERSONALITIES: &[u32] = &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// Every 32-bit `personality` argument outside [`ALLOWED_PERSONALITIES`], as `(mask, value)`
/// pairs (`arg & mask == value`) that together cover exactly that complement. A filter on a
/// default-allow list cannot say "not one of these" in one rule (libseccomp, and so Docker's
/// profile, takes one comparison per argument), so the complement is split along a binary trie:
/// a prefix no allowed value starts with is one pair.
pub fn denied_personality_masks() -> Vec<(u32, u32)> {
    fn split(prefix: u32, bits: u32, allowed: &[u32], out: &mut Vec<(u32, u32)>) {
        let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
        let inside: Vec<u32> = allowed.iter().copied().filter(|v| v & mask == prefix).collect();
        if inside.is_empty() {
            out.push((mask, prefix));
        } else if bits < 32 {
            let next = 1u32 << (31 - bits);
            split(prefix, bits + 1, &inside, out);
            split(prefix | next, bits + 1, &inside, out);
        }
    }
    let mut out = Vec::new();
    split(0, 0, ALLOWED_PERSONALITIES, &mut out);
    out
}

/// `clone` flags that would create namespaces (a way around the unshare/setns denial).
const NAMESPACE_CLONE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn arch() -> Result<TargetArch, SeccompError> {
    std::env::consts::ARCH.try_into().map_err(|e| SeccompError::Build(format!("{e:?}")))
}

/// The deny-list program (EPERM on match).
fn deny_program() -> Result<BpfProgram, SeccompError> {
    let build = |e: seccompiler::BackendError| SeccompError::Build(e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED_FAMILIES.iter().flat_map(|(_, calls)| calls.iter()).map(|&(_, nr)| (nr, vec![])).collect();
    let clone_rules = NAMESPACE_CLONE_FLAGS
        .iter()
        .map(|&flag| {
            let cond = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(flag), flag).map_err(build)?;
            SeccompRule::new(vec![cond]).map_err(build)
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let socket_rules = DENIED_SOCKET_FAMILIES
        .iter()
        .map(|&(_, family)| {
            let cond = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family as u64).map_err(build)?;
            SeccompRule::new(vec![cond]).map_err(build)
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_socket, socket_rules);
    let personality_rules = denied_personality_masks()
        .into_iter()
        .map(|(mask, value)| {
            let cond = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(u64::from(mask)), u64::from(value)).map_err(build)?;
            SeccompRule::new(vec![cond]).map_err(build)
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_personality, personality_rules);
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch()?).map_err(build)?;
    filter.try_into().map_err(|e: seccompiler::BackendError| build(e))
}

/// `clone3` → ENOSYS, so libc falls back to `clone`.
fn clone3_program() -> Result<BpfProgram, SeccompError> {
    let build = |e: seccompiler::BackendError| SeccompError::Build(e.to_string());
    let rules: BTreeMap<i64, Vec<SeccompRule>> = [(libc::SYS_clone3, vec![])].into_iter().collect();
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch()?).map_err(build)?;
    filter.try_into().map_err(|e: seccompiler::BackendError| build(e))
}

/// Installs both filters on the calling thread (inherited by every child). Needs no_new_privs
/// or CAP_SYS_ADMIN.
pub fn install() -> Result<(), SeccompError> {
    let deny = deny_program()?;
    let clone3 = clone3_program()?;
    seccompiler::apply_filter(&deny).map_err(|e| SeccompError::Install(e.to_string()))?;
    seccompiler::apply_filter(&clone3).map_err(|e| SeccompError::Install(e.to_string()))?;
    Ok(())
}

/// The same filter as a Docker seccomp profile (the JSON `security_opt: seccomp=…` takes), for
/// the container tier: allow by default, deny every call of [`DENIED_FAMILIES`] with EPERM,
/// `clone` with a namespace flag too, and `clone3` with ENOSYS. One list for both tiers that
/// share the host kernel: Docker's own default profile differs between Engine versions (20.10
/// still allows io_uring).
pub fn docker_profile() -> String {
    let denied: Vec<&str> = DENIED_FAMILIES.iter().flat_map(|(_, calls)| calls.iter()).map(|(name, _)| name.trim_start_matches("SYS_")).collect();
    let mut syscalls = vec![
        serde_json::json!({ "names": denied, "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM }),
        serde_json::json!({ "names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::ENOSYS }),
    ];
    for &flag in NAMESPACE_CLONE_FLAGS {
        syscalls.push(serde_json::json!({
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": libc::EPERM,
            "args": [{ "index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ" }],
        }));
    }
    for &(_, family) in DENIED_SOCKET_FAMILIES {
        syscalls.push(serde_json::json!({
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": libc::EPERM,
            "args": [{ "index": 0, "value": family, "valueTwo": 0, "op": "SCMP_CMP_EQ" }],
        }));
    }
    for (mask, value) in denied_personality_masks() {
        syscalls.push(serde_json::json!({
            "names": ["personality"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": libc::EPERM,
            // libseccomp's MASKED_EQ: `value` is the mask, `valueTwo` what the masked
            // argument must equal (Docker's own profile writes `clone`'s rule this way).
            "args": [{ "index": 0, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ" }],
        }));
    }
    serde_json::json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": syscalls,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docker_profile_denies_the_same_list() {
        let profile: serde_json::Value = serde_json::from_str(&docker_profile()).expect("json");
        assert_eq!(profile["defaultAction"], "SCMP_ACT_ALLOW");
        let names: Vec<String> = profile["syscalls"][0]["names"].as_array().expect("names").iter().filter_map(|n| n.as_str().map(str::to_string)).collect();
        for (_, calls) in DENIED_FAMILIES {
            for (name, _) in calls.iter() {
                assert!(names.iter().any(|n| format!("SYS_{n}") == *name), "{name} missing from the Docker profile");
            }
        }
        assert!(names.contains(&"io_uring_setup".to_string()));
    }

    #[test]
    fn filters_compile_for_this_arch() {
        assert!(!deny_program().expect("deny program").is_empty());
        assert!(!clone3_program().expect("clone3 program").is_empty());
    }

    /// Runs `body` in a forked child with no_new_privs and the filters installed (so they do
    /// not stick to the test harness) and returns its exit code: `body`'s, or 99 when the
    /// filters could not be installed (asserted here).
    fn in_filtered_child(body: impl FnOnce() -> i32) -> i32 {
        // SAFETY: the child only makes syscalls and _exits (install() allocates, acceptable in
        // a test: the parent waits).
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                // No controlling terminal, so even vhangup could not touch the test's terminal.
                let _ = nix::unistd::setsid();
                // SAFETY: prctl with integer arguments.
                unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
                let code = if install().is_err() { 99 } else { body() };
                // SAFETY: _exit in a forked child.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).expect("waitpid");
                let nix::sys::wait::WaitStatus::Exited(_, code) = status else { panic!("child ended with {status:?}") };
                assert!(code != 99, "the filter could not be installed");
                code
            }
        }
    }

    /// In a forked child with the filter installed, calls every syscall of `family` (zero
    /// arguments: harmless even if it got through) and exits 0 only if each was refused with
    /// EPERM by the filter. Exit code 100+i names the first call that got through.
    fn family_is_denied(family: &str) {
        let calls = DENIED_FAMILIES.iter().find(|(name, _)| *name == family).map(|(_, c)| *c).expect("family");
        let code = in_filtered_child(|| {
            for (i, &(_, nr)) in calls.iter().enumerate() {
                // SAFETY: a raw syscall with zero arguments; the filter refuses it before the
                // kernel reads any of them.
                let r = unsafe { libc::syscall(nr, 0, 0, 0, 0, 0, 0) };
                if r != -1 || nix::errno::Errno::last() != nix::errno::Errno::EPERM {
                    return 100 + i as i32;
                }
            }
            0
        });
        assert_eq!(code, 0, "family {family}: syscall {} got through the filter", calls[(code - 100).max(0) as usize].0);
    }

    macro_rules! denied {
        ($($test:ident => $family:literal),* $(,)?) => {
            $(#[test] fn $test() { family_is_denied($family) })*
            #[test]
            fn every_family_has_a_test() {
                let tested = [$($family),*];
                for (name, _) in DENIED_FAMILIES {
                    assert!(tested.contains(name), "family {name} has no test");
                }
            }
        };
    }

    denied! {
        mount_family_is_denied => "mount",
        namespace_family_is_denied => "namespaces",
        module_family_is_denied => "kernel modules and kexec",
        bpf_is_denied => "bpf",
        keyring_family_is_denied => "keyring",
        perf_family_is_denied => "perf and tracing",
        userfaultfd_is_denied => "userfaultfd",
        io_uring_family_is_denied => "io_uring",
        process_inspection_family_is_denied => "process inspection",
        file_handle_family_is_denied => "file handles",
        clock_family_is_denied => "clock",
        sysadmin_family_is_denied => "system administration",
        numa_family_is_denied => "numa placement",
    }

    #[test]
    fn the_docker_profile_denies_the_same_socket_families() {
        let profile: serde_json::Value = serde_json::from_str(&docker_profile()).expect("json");
        let denied: Vec<i64> = profile["syscalls"]
            .as_array()
            .expect("syscalls")
            .iter()
            .filter(|r| r["names"][0] == "socket" && r["errnoRet"] == libc::EPERM)
            .filter_map(|r| r["args"][0]["value"].as_i64())
            .collect();
        for &(name, family) in DENIED_SOCKET_FAMILIES {
            assert!(denied.contains(&i64::from(family)), "{name} missing from the Docker profile");
        }
    }

    /// In a forked child with the filter installed, opens a socket of every denied family and
    /// exits 0 only if each was refused with EPERM — the filter's answer, where a host without
    /// the family's module says EAFNOSUPPORT — and an ordinary AF_UNIX and AF_INET socket opens.
    #[test]
    fn denied_socket_families_are_refused_and_ordinary_ones_open() {
        let code = in_filtered_child(|| {
            let mut code = 0;
            for (i, &(_, family)) in DENIED_SOCKET_FAMILIES.iter().enumerate() {
                for kind in [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET] {
                    // SAFETY: socket(2) with integer arguments.
                    let fd = unsafe { libc::socket(family, kind, 0) };
                    if fd >= 0 || nix::errno::Errno::last() != nix::errno::Errno::EPERM {
                        code = 100 + i as i32;
                    }
                }
            }
            for family in [libc::AF_UNIX, libc::AF_INET] {
                // SAFETY: socket(2) with integer arguments.
                if unsafe { libc::socket(family, libc::SOCK_STREAM, 0) } < 0 {
                    code = 98;
                }
            }
            code
        });
        assert!(code != 98, "an ordinary AF_UNIX or AF_INET socket was refused");
        assert_eq!(code, 0, "{} got through the filter", DENIED_SOCKET_FAMILIES[(code - 100).max(0) as usize].0);
    }

    #[test]
    fn personality_masks_refuse_exactly_what_is_not_allowed() {
        let masks = denied_personality_masks();
        let denied = |x: u32| masks.iter().any(|&(mask, value)| x & mask == value);
        for &v in ALLOWED_PERSONALITIES {
            assert!(!denied(v), "{v:#x} is allowed but a mask matches it");
        }
        // Every single flag bit and a spread of other values.
        let mut others: Vec<u32> = (0..32).map(|b| 1u32 << b).collect();
        others.extend([
            0x0040_0000, /* READ_IMPLIES_EXEC */
            0x0004_0000, /* ADDR_NO_RANDOMIZE */
            0x9,
            0x2_0009,
            0xffff_fffe,
            0x7fff_ffff,
            0x0010_0008,
        ]);
        let mut x: u32 = 0x1234_5678;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            others.push(x);
        }
        for v in others.into_iter().filter(|v| !ALLOWED_PERSONALITIES.contains(v)) {
            assert!(denied(v), "{v:#x} is not allowed but no mask matches it");
        }
        // Small enough for a BPF program and a Docker profile.
        assert!(masks.len() < 200, "{} pieces", masks.len());
    }

    #[test]
    fn the_docker_profile_refuses_the_same_personas() {
        let profile: serde_json::Value = serde_json::from_str(&docker_profile()).expect("json");
        let rules: Vec<(u64, u64)> = profile["syscalls"]
            .as_array()
            .expect("syscalls")
            .iter()
            .filter(|r| r["names"][0] == "personality" && r["errnoRet"] == libc::EPERM && r["args"][0]["op"] == "SCMP_CMP_MASKED_EQ")
            .filter_map(|r| Some((r["args"][0]["value"].as_u64()?, r["args"][0]["valueTwo"].as_u64()?)))
            .collect();
        let expected: Vec<(u64, u64)> = denied_personality_masks().into_iter().map(|(m, v)| (u64::from(m), u64::from(v))).collect();
        assert_eq!(rules, expected, "the profile's (mask, datum) pairs");
        let matches = |x: u64| rules.iter().any(|&(mask, datum)| x & mask == datum);
        assert!(matches(0x0040_0000), "READ_IMPLIES_EXEC must be refused");
        assert!(!matches(0x8) && !matches(0xffff_ffff), "PER_LINUX32 and the query must pass");
    }

    #[test]
    fn installed_filter_refuses_personas_outside_the_list() {
        let code = in_filtered_child(|| {
            let mut code = 0;
            // ADDR_NO_RANDOMIZE and READ_IMPLIES_EXEC: refused.
            for (i, persona) in [0x0004_0000u64, 0x0040_0000].into_iter().enumerate() {
                // SAFETY: personality(2) with an integer argument.
                let r = unsafe { libc::syscall(libc::SYS_personality, persona) };
                if r != -1 || nix::errno::Errno::last() != nix::errno::Errno::EPERM {
                    code = 10 + i as i32;
                }
            }
            // The query and PER_LINUX: allowed.
            // SAFETY: as above.
            if unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) } < 0 || unsafe { libc::syscall(libc::SYS_personality, 0u64) } < 0 {
                code = 20;
            }
            code
        });
        assert!(code != 20, "the personality query or PER_LINUX was refused");
        assert_eq!(code, 0, "a persona outside Docker's list got through the filter");
    }

    #[test]
    fn installed_filter_denies_unshare_and_mount_but_not_getpid() {
        let code = in_filtered_child(|| {
            let unshare = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER);
            let mount = nix::mount::mount(Some("none"), "/tmp", Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>);
            match (unshare, mount, nix::unistd::getpid().as_raw() > 0) {
                (Err(nix::errno::Errno::EPERM), Err(nix::errno::Errno::EPERM), true) => 0,
                _ => 11,
            }
        });
        assert_eq!(code, 0, "unshare or mount got through the filter, or getpid did not");
    }
}
