/* Hostile probes for the escape suite (tests/tests/escape.rs). Built static by the tests
 * (gcc -static), copied into a sandbox and run there as root, like untrusted code would be.
 *
 * Usage: escape_probe <attack>
 * Exit 0 with "BLOCKED: ..." when the attack failed, 1 with "ESCAPE: ..." when it worked,
 * 2 on a usage error. Never trust a probe that cannot fail: each one reports what it did.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int escaped = 0;

static void verdict(int worked, const char *what, int err) {
    if (worked) {
        printf("ESCAPE: %s\n", what);
        escaped = 1;
    } else {
        printf("BLOCKED: %s (%s)\n", what, strerror(err));
    }
}

/* A setuid-root binary's payload: what uid do we end up with? */
static int do_setuid(void) {
    setresuid(0, 0, 0);
    setresgid(0, 0, 0);
    printf("uid=%d euid=%d\n", (int)getuid(), (int)geteuid());
    return 0;
}

/* PID 1 is the sandbox's init, which holds the daemon's control socket. */
static int do_pid1(void) {
    long r = ptrace(PTRACE_SEIZE, 1, 0, 0);
    verdict(r == 0, "PTRACE_SEIZE of PID 1", errno);
    if (r == 0) ptrace(PTRACE_DETACH, 1, 0, 0);

    errno = 0;
    r = ptrace(PTRACE_ATTACH, 1, 0, 0);
    verdict(r == 0, "PTRACE_ATTACH of PID 1", errno);
    if (r == 0) { waitpid(1, 0, __WALL); ptrace(PTRACE_DETACH, 1, 0, 0); }

    int pidfd = (int)syscall(SYS_pidfd_open, 1, 0);
    if (pidfd < 0) {
        verdict(0, "pidfd_open(1)", errno);
    } else {
        for (int target = 0; target < 16; target++) {
            int fd = (int)syscall(SYS_pidfd_getfd, pidfd, target, 0);
            if (fd >= 0) {
                char what[64];
                snprintf(what, sizeof what, "pidfd_getfd(PID 1, %d)", target);
                verdict(1, what, 0);
                close(fd);
            }
        }
        verdict(0, "pidfd_getfd of PID 1's descriptors 0-15", errno);
    }

    const char *paths[] = {"/proc/1/fd/0", "/proc/1/fd/1", "/proc/1/fd/2", "/proc/1/fd/3", "/proc/1/mem", "/proc/1/environ"};
    for (unsigned i = 0; i < sizeof paths / sizeof *paths; i++) {
        int fd = open(paths[i], O_RDWR);
        if (fd < 0) fd = open(paths[i], O_WRONLY);
        if (fd < 0) fd = open(paths[i], O_RDONLY);
        char what[64];
        snprintf(what, sizeof what, "open %s", paths[i]);
        verdict(fd >= 0, what, errno);
        if (fd >= 0) close(fd);
    }
    /* runc CVE-2019-5736: re-open the runtime's executable through /proc/<pid>/exe. */
    int fd = open("/proc/1/exe", O_RDONLY);
    verdict(fd >= 0, "open /proc/1/exe", errno);
    if (fd >= 0) close(fd);
    char link[256];
    ssize_t n = readlink("/proc/1/exe", link, sizeof link - 1);
    verdict(n >= 0, "readlink /proc/1/exe", errno);
    /* Root may list PID 1's descriptor numbers; it must not follow or resolve any of them. */
    DIR *d = opendir("/proc/1/fd");
    if (d) {
        struct dirent *e;
        int resolved = 0, last = 0;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char path[300], target[256];
            snprintf(path, sizeof path, "/proc/1/fd/%s", e->d_name);
            if (readlink(path, target, sizeof target - 1) >= 0) resolved = 1; else last = errno;
        }
        closedir(d);
        verdict(resolved, "readlink of PID 1's descriptors", last);
    }

    /* Signals from inside cannot end the namespace's init. */
    kill(1, SIGKILL);
    kill(1, SIGTERM);
    usleep(200 * 1000);
    verdict(kill(1, 0) != 0, "PID 1 killed from inside", 0);
    return escaped;
}

/* Every descriptor of this process must be one it was given (0, 1, 2): runc CVE-2024-21626. */
static int do_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) { printf("cannot list /proc/self/fd: %s\n", strerror(errno)); return 2; }
    int dfd = dirfd(d);
    struct dirent *e;
    int leaked = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        int fd = atoi(e->d_name);
        if (fd <= 2 || fd == dfd) continue;
        char path[64], target[512] = {0};
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        readlink(path, target, sizeof target - 1);
        printf("ESCAPE: inherited fd %d -> %s\n", fd, target);
        leaked = 1;
    }
    closedir(d);
    if (!leaked) printf("BLOCKED: no descriptor beyond stdio\n");
    return leaked;
}

static int do_io_uring(void) {
    char params[120] = {0};
    long r = syscall(SYS_io_uring_setup, 4, params);
    verdict(r >= 0, "io_uring_setup", errno);
    return escaped;
}

/* vsock is not network-namespaced: a socket would reach the host's (and other guests') vsock
 * services. Only the seccomp filter's EPERM counts as blocked: a host without the vsock module
 * answers EAFNOSUPPORT on its own, which would prove nothing about the filter. */
static int do_vsock(void) {
    int types[] = {SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET};
    for (unsigned i = 0; i < sizeof types / sizeof types[0]; i++) {
        errno = 0;
        int fd = socket(40 /* AF_VSOCK */, types[i], 0);
        int err = errno;
        verdict(fd >= 0 || err != EPERM, "socket(AF_VSOCK) not refused by the filter", err);
        if (fd >= 0) close(fd);
    }
    return escaped;
}

/* personality(2) flags that switch hardening off for the caller and its children: Docker's
 * default profile allows only PER_LINUX, PER_LINUX32, UNAME26 (and their union) and the query.
 * ADDR_NO_RANDOMIZE turns ASLR off, READ_IMPLIES_EXEC makes readable mappings executable. */
static int do_personality(void) {
    unsigned long personas[] = {0x0040000 /* ADDR_NO_RANDOMIZE */, 0x0400000 /* READ_IMPLIES_EXEC */, 0x0100000 /* MMAP_PAGE_ZERO */};
    const char *names[] = {"personality(ADDR_NO_RANDOMIZE)", "personality(READ_IMPLIES_EXEC)", "personality(MMAP_PAGE_ZERO)"};
    for (unsigned i = 0; i < sizeof personas / sizeof personas[0]; i++) {
        errno = 0;
        long r = syscall(SYS_personality, personas[i]);
        int err = errno;
        verdict(r != -1 || err != EPERM, names[i], err);
    }
    /* The query must still work: glibc and setarch read it. */
    if (syscall(SYS_personality, 0xffffffffUL) == -1) {
        printf("ESCAPE: the personality query was refused (%s): the filter is too broad\n", strerror(errno));
        escaped = 1;
    }
    return escaped;
}

/* Writes `value` to `path`; reports a write that got through (or a file that could be made). */
static void try_write(const char *path, const char *value) {
    char what[256];
    snprintf(what, sizeof what, "write %s to %s", value, path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) { verdict(0, what, errno); return; }
    ssize_t n = write(fd, value, strlen(value));
    int err = errno;
    close(fd);
    verdict(n == (ssize_t)strlen(value), what, err);
}

static void try_mount(const char *src, const char *target, const char *type, unsigned long flags, const char *data, const char *what) {
    errno = 0;
    int r = mount(src, target, type, flags, data);
    verdict(r == 0, what, errno);
}

/* The sandbox's view of its own cgroup (/sys/fs/cgroup) must stay read-only and un-remountable,
 * and no cgroupfs may be mounted again: CVE-2022-0492 (release_agent) and every way around a
 * read-only mount. v1 and v2 paths are both tried; a missing file is reported as blocked. */
static int do_cgroup(void) {
    const char *files[] = {
        "/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs", "/sys/fs/cgroup/cgroup.procs",
        "/sys/fs/cgroup/memory/release_agent", "/sys/fs/cgroup/pids/release_agent", "/sys/fs/cgroup/release_agent",
        "/sys/fs/cgroup/memory/notify_on_release", "/sys/fs/cgroup/cgroup.subtree_control",
        "/sys/fs/cgroup/planted", "/sys/devices/system/cpu/online", "/sys/kernel/uevent_helper",
    };
    char pid[32];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) try_write(files[i], strstr(files[i], "procs") ? pid : "1");
    /* Each call before its verdict: the order arguments are evaluated in is unspecified. */
    int r = mkdir("/sys/fs/cgroup/memory/escape", 0755);
    verdict(r == 0, "mkdir a cgroup in /sys/fs/cgroup/memory", errno);
    r = mkdir("/sys/fs/cgroup/escape", 0755);
    verdict(r == 0, "mkdir in /sys/fs/cgroup", errno);

    mkdir("/tmp/cgprobe", 0755);
    try_mount("cgroup", "/tmp/cgprobe", "cgroup", 0, "memory", "mount cgroup v1 memory");
    try_mount("cgroup", "/tmp/cgprobe", "cgroup", 0, "rdma,release_agent=/tmp/x", "mount a new cgroup v1 hierarchy with release_agent");
    try_mount("cgroup2", "/tmp/cgprobe", "cgroup2", 0, NULL, "mount cgroup2");
    try_mount("sysfs", "/tmp/cgprobe", "sysfs", 0, NULL, "mount sysfs");
    try_mount(NULL, "/sys/fs/cgroup", NULL, MS_REMOUNT | MS_BIND, NULL, "remount /sys/fs/cgroup read-write");
    try_mount(NULL, "/sys/fs/cgroup/memory", NULL, MS_REMOUNT | MS_BIND, NULL, "remount /sys/fs/cgroup/memory read-write");
    try_mount(NULL, "/sys", NULL, MS_REMOUNT, NULL, "remount /sys read-write");
    try_mount("/sys/fs/cgroup", "/tmp/cgprobe", NULL, MS_BIND | MS_REC, NULL, "bind /sys/fs/cgroup elsewhere");
    r = umount2("/sys/fs/cgroup", MNT_DETACH);
    verdict(r == 0, "unmount /sys/fs/cgroup", errno);
    r = umount2("/sys/devices/system/cpu/online", MNT_DETACH);
    verdict(r == 0, "unmount the CPU list", errno);
    long fs = syscall(SYS_fsopen, "cgroup2", 0);
    verdict(fs >= 0, "fsopen(cgroup2)", errno);
    /* CVE-2022-0492 the classic way: a user namespace gives CAP_SYS_ADMIN over a new cgroupfs. */
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP) == 0) {
        verdict(1, "unshare a user, mount and cgroup namespace", 0);
        try_mount("cgroup", "/tmp/cgprobe", "cgroup", 0, "rdma", "mount cgroup v1 in a user namespace");
    } else {
        verdict(0, "unshare a user, mount and cgroup namespace", errno);
    }
    /* After all that, the view is still read-only. */
    try_write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1");
    try_write("/sys/fs/cgroup/memory.max", "1");
    return escaped;
}

/* Not an attack: what must keep working. Code in a sandbox traces its own children (strace,
 * gdb). Exit 0 with "OK" when a child could be seized, stopped and inspected. */
static int do_ptrace_child(void) {
    pid_t child = fork();
    if (child == 0) { pause(); _exit(0); }
    if (ptrace(PTRACE_SEIZE, child, 0, 0) != 0) { printf("FAILED: PTRACE_SEIZE of own child: %s\n", strerror(errno)); kill(child, SIGKILL); return 1; }
    if (ptrace(PTRACE_INTERRUPT, child, 0, 0) != 0) { printf("FAILED: PTRACE_INTERRUPT: %s\n", strerror(errno)); kill(child, SIGKILL); return 1; }
    int status = 0;
    waitpid(child, &status, __WALL);
    long word = ptrace(PTRACE_PEEKUSER, child, 0, 0);
    int ok = WIFSTOPPED(status) && !(word == -1 && errno);
    kill(child, SIGKILL);
    waitpid(child, &status, __WALL);
    printf(ok ? "OK: traced own child\n" : "FAILED: own child not stopped\n");
    return ok ? 0 : 1;
}


/* Whether /proc/<pid>/cmdline is the container tier's exec helper serving execs. */
static int is_keepalive(int pid) {
    char path[64], buf[256] = {0};
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n > 0 && !strcmp(buf, "/.sandboxd/sandbox-exec") && (size_t)n > strlen(buf) + 1 && !strcmp(buf + strlen(buf) + 1, "--serve");
}

/* Whether an executable's path (as /proc shows it) is a host binary: the exec helper, the
 * init Docker mounts in, or a runtime's own (runc, containerd, sandboxd). Every other one is a
 * file of the container's own filesystem, which root inside may write anyway. */
static int is_host_binary(const char *link) {
    return !strncmp(link, "/.sandboxd/", 11) || !strcmp(link, "/sbin/docker-init") || !strcmp(link, "/dev/init") || strstr(link, "runc") ||
           strstr(link, "containerd") || strstr(link, "docker") || strstr(link, "sandboxd") || strstr(link, "memfd:");
}

/* runc CVE-2019-5736 and its class: no process here (PID 1, the exec helper serving execs, a
 * process being started) may give us its executable for writing, directly or through an O_PATH
 * descriptor re-opened later; the helper's descriptors (the daemon's channel) are out of reach.
 * Scans /proc for `ms` milliseconds, so processes caught while an exec enters count too.
 * Prints one line per kind of attempt, and "SEEN" counts. */
static int do_exe(int ms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int self = getpid(), helper_seen = 0, helper_blocked = 0, others = 0, last_err = 0, raced = 0;
    do {
        DIR *d = opendir("/proc");
        if (!d) { printf("cannot list /proc: %s\n", strerror(errno)); return 2; }
        struct dirent *e;
        while ((e = readdir(d))) {
            int pid = atoi(e->d_name);
            if (pid <= 0 || pid == self) continue;
            char exe[64], what[512];
            snprintf(exe, sizeof exe, "/proc/%d/exe", pid);
            int path_fd = open(exe, O_PATH);
            if (path_fd >= 0) {
                char again[64], link[256] = {0};
                snprintf(again, sizeof again, "/proc/self/fd/%d", path_fd);
                if (readlink(again, link, sizeof link - 1) < 0 || is_host_binary(link)) {
                    int fd = open(exe, O_WRONLY);
                    if (fd >= 0) { snprintf(what, sizeof what, "open %s (%s) for writing", exe, link); verdict(1, what, 0); close(fd); }
                    fd = open(again, O_WRONLY);
                    if (fd >= 0) { snprintf(what, sizeof what, "re-open of %s (%s, O_PATH) for writing", exe, link); verdict(1, what, 0); close(fd); }
                    else last_err = errno;
                }
                close(path_fd);
            }
            if (is_keepalive(pid)) {
                helper_seen = 1;
                /* The exe was opened before the cmdline was read: a process that had already
                 * left the helper's image by execve would not show its cmdline. */
                if (path_fd >= 0) { snprintf(what, sizeof what, "O_PATH open of the exec helper's %s", exe); verdict(1, what, 0); }
                else helper_blocked = 1;
                /* A forked child of the helper shows the helper's cmdline until its execve, and
                 * after it is an ordinary process of the sandbox's (dumpable: its descriptors
                 * are the sandbox's own). What was reached counts only if the process still
                 * shows the helper's cmdline afterwards, i.e. had not yet left its image. */
                char hits[1024] = {0};
                size_t used = 0;
                int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
                for (int target = 0; pidfd >= 0 && target < 16; target++) {
                    int got = (int)syscall(SYS_pidfd_getfd, pidfd, target, 0);
                    if (got >= 0) { used += snprintf(hits + used, sizeof hits - used, "ESCAPE: pidfd_getfd(exec helper, %d)\n", target); close(got); }
                    if (used >= sizeof hits) used = sizeof hits - 1;
                }
                for (int target = 0; target < 16; target++) {
                    char fdp[64];
                    snprintf(fdp, sizeof fdp, "/proc/%d/fd/%d", pid, target);
                    int got = open(fdp, O_RDWR);
                    if (got >= 0) { used += snprintf(hits + used, sizeof hits - used, "ESCAPE: open %s\n", fdp); close(got); }
                    if (used >= sizeof hits) used = sizeof hits - 1;
                }
                int still = is_keepalive(pid);
                if (pidfd >= 0) close(pidfd);
                if (used && still) { fputs(hits, stdout); escaped = 1; }
                else if (used) raced++;
            } else {
                others++;
            }
        }
        closedir(d);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 < ms);
    if (!helper_seen) { printf("the exec helper (/.sandboxd/sandbox-exec --serve) was not found\n"); return 2; }
    verdict(!helper_blocked, "O_PATH open of the exec helper's /proc/<pid>/exe", EACCES);
    verdict(0, "opening any /proc/<pid>/exe for writing", last_err ? last_err : EACCES);
    printf("SEEN: %d process looks, %d helper children that reached execve mid-look\n", others, raced);
    return escaped;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 2) return 2;
    if (!strcmp(argv[1], "setuid")) return do_setuid();
    if (!strcmp(argv[1], "pid1")) return do_pid1();
    if (!strcmp(argv[1], "exe")) return do_exe(argc > 2 ? atoi(argv[2]) : 0);
    if (!strcmp(argv[1], "fds")) return do_fds();
    if (!strcmp(argv[1], "io_uring")) return do_io_uring();
    if (!strcmp(argv[1], "vsock")) return do_vsock();
    if (!strcmp(argv[1], "personality")) return do_personality();
    if (!strcmp(argv[1], "ptrace_child")) return do_ptrace_child();
    if (!strcmp(argv[1], "cgroup")) return do_cgroup();
    fprintf(stderr, "unknown probe %s\n", argv[1]);
    return 2;
}
