//! Checks that more than one suite makes, written once: what a user of the API must see of
//! files in any sandbox.

use agent_client::Client;
use tonic::Code;

use crate::{assert_exited, text, unique, Harness};

/// Writes `hello world` with mode 0640 to /workspace/a/b/c/hello.txt (its parents created) and
/// checks that ReadFile serves it whole, by offset and limit, and past its end, each time with
/// its size and whether the read reached the end.
pub async fn assert_hello_file_reads_back(c: &Client, id: &str) {
    let n = c.write_file(id, "/workspace/a/b/c/hello.txt", b"hello world".to_vec(), 0o640).await.expect("WriteFile");
    assert_eq!(n, 11);
    let whole = c.read_file(id, "/workspace/a/b/c/hello.txt", 0, 0).await.expect("ReadFile");
    assert_eq!((whole.content.as_slice(), whole.size, whole.eof), (&b"hello world"[..], 11, true));
    let head = c.read_file(id, "/workspace/a/b/c/hello.txt", 0, 5).await.expect("ReadFile");
    assert_eq!((head.content.as_slice(), head.size, head.eof), (&b"hello"[..], 11, false));
    let tail = c.read_file(id, "/workspace/a/b/c/hello.txt", 6, 100).await.expect("ReadFile");
    assert_eq!((tail.content.as_slice(), tail.eof), (&b"world"[..], true));
    let past = c.read_file(id, "/workspace/a/b/c/hello.txt", 50, 0).await.expect("ReadFile past the end");
    assert!(past.content.is_empty() && past.eof, "{past:?}");
}

/// Paths given to the file API never leave sandbox `id`: `..` is clamped at the sandbox's root
/// for writes and reads, and symlinks planted inside (absolute and relative, to a host file and
/// to a host directory) resolve inside, for reads and writes. Leaves no file on the host.
pub async fn assert_paths_stay_inside(h: &Harness, id: &str) {
    let c = &h.client;

    // `..` is clamped at the sandbox's root, for writes and reads.
    let name = unique("sandboxd-escape");
    let host_path = std::path::PathBuf::from("/etc").join(&name);
    assert!(!host_path.exists());
    c.write_file(id, format!("../../../../etc/{name}"), b"escaped?".to_vec(), 0).await.expect("WriteFile with ..");
    assert!(!host_path.exists(), "WriteFile through .. created {} on the host", host_path.display());
    assert_eq!(h.sh_ok(id, &format!("cat /etc/{name}")).await, "escaped?", "the file landed inside at /etc/{name}");
    let r = c.read_file(id, format!("/workspace/../../../../../etc/{name}"), 0, 0).await.expect("ReadFile with ..");
    assert_eq!(r.content, b"escaped?");

    // Symlinks planted inside resolve inside, whatever they point to.
    let secret_path = std::env::temp_dir().join(unique("sandboxd-secret"));
    std::fs::write(&secret_path, b"HOST SECRET").expect("writing host secret");
    let secret = secret_path.display().to_string();
    let links = h.sh(id, &format!("ln -s {secret} /workspace/abs && ln -s ../../../../../../../..{secret} /workspace/rel")).await;
    assert_exited(&links, 0);
    for link in ["/workspace/abs", "/workspace/rel"] {
        match c.read_file(id, link, 0, 0).await {
            Ok(r) => panic!("ReadFile({link}) returned {:?} although {secret} does not exist inside", text(&r.content)),
            Err(e) => assert_eq!(e.code(), Code::NotFound, "ReadFile({link}): {e}"),
        }
    }
    h.sh_ok(id, &format!("mkdir -p {} && echo sandbox-copy > {secret}", std::env::temp_dir().display())).await;
    for link in ["/workspace/abs", "/workspace/rel"] {
        let r = c.read_file(id, link, 0, 0).await.expect("ReadFile through a link");
        assert_eq!(text(&r.content), "sandbox-copy\n", "ReadFile({link}) must read the sandbox's file");
    }
    // Writing through a link to a host directory stays inside too.
    let planted = unique("sandboxd-planted");
    h.sh_ok(id, &format!("ln -s {} /workspace/hostdir", std::env::temp_dir().display())).await;
    c.write_file(id, format!("/workspace/hostdir/{planted}"), b"x".to_vec(), 0).await.expect("WriteFile through a link");
    assert!(!std::env::temp_dir().join(&planted).exists(), "WriteFile through a symlink wrote on the host");
    assert_eq!(std::fs::read(&secret_path).expect("host secret"), b"HOST SECRET", "the host's file was changed");
    let _ = std::fs::remove_file(&secret_path);
}
