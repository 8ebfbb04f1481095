//! The READMEs walked as a newcomer would walk them: every `sh` block of README.md and
//! agent-client/README.md that runs `sbx` is run, line by line, against a real daemon, with the
//! reader's placeholders filled in (`ID` is a `debian` sandbox made for the walk, `RUN_ID` the newest
//! agent run, `some-producer` prints a few lines). A line fails the test when it exits with
//! anything but 0 (or the code its own `exit N` asks for). Lines that need what a test cannot
//! give (a terminal, a model server of the reader's) are skipped by rule, and the skipped set is
//! pinned, so a new example is walked or consciously skipped, never silently left out.
#![allow(clippy::expect_used, clippy::unwrap_used)] // test harness: a failed expectation is a failed test

use std::path::Path;

use sandbox_tests::{sbx_bin, workspace_root, Daemon};

/// Every README line not run, with why (in README order).
const EXPECTED_SKIPS: &[&str] = &[
    "agent-client/README.md: sbx exec -it ID -- python3 (needs a terminal)",
    "agent-client/README.md: sbx shell ID (needs a terminal)",
    "agent-client/README.md: export SANDBOXD_SOCKET=unix://$PWD/.sandboxd/sandboxd.sock (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: export OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=… (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent run --task \"make the tests in /workspace pass\" --verify \"make test\" --json (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent resume RUN_ID --json (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent resume RUN_ID --max-steps 100 (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent ls (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent show RUN_ID (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent steer RUN_ID \"use python3, not python\" (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: sbx agent stop RUN_ID --done --reason \"good enough\" (an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop))",
    "agent-client/README.md: llama-server -m qwen2.5-coder-7b-instruct-q4_k_m.gguf --jinja -c 32768 --port 8080 (a local model server of the reader's (llama.cpp, Ollama))",
    "agent-client/README.md: OPENAI_BASE_URL=http://127.0.0.1:8080/v1 sbx agent run --model qwen2.5-coder --context-window 32768 --task \"…\" (a local model server of the reader's (llama.cpp, Ollama))",
    "agent-client/README.md: ollama pull qwen2.5-coder:7b (a local model server of the reader's (llama.cpp, Ollama))",
    "agent-client/README.md: OPENAI_BASE_URL=http://127.0.0.1:11434/v1 sbx agent run --model qwen2.5-coder:7b --context-window 32768 --task \"…\" (a local model server of the reader's (llama.cpp, Ollama))",
];

/// A fenced ```sh block: the file, its first line number, and its lines.
struct Block {
    file: &'static str,
    line: usize,
    lines: Vec<String>,
}

fn sh_blocks(file: &'static str) -> Vec<Block> {
    let text = std::fs::read_to_string(workspace_root().join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"));
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(Block { file, line: i + 2, lines: Vec::new() }),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(b), l) => b.lines.push(l.to_string()),
            (None, _) => {}
        }
    }
    blocks.into_iter().filter(|b| b.lines.iter().any(|l| l.contains("sbx"))).collect()
}

/// Why a line is not run, if it is not.
fn skip_reason(block: &Block, line: &str) -> Option<&'static str> {
    let text = block.lines.join("\n");
    if text.contains("llama-server") || text.contains("ollama") {
        return Some("a local model server of the reader's (llama.cpp, Ollama)");
    }
    if text.contains("OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY") {
        return Some("an OpenAI-compatible endpoint of the reader's (the demo-model block walks the loop)");
    }
    if line.contains(" -it ") || line.trim_start().starts_with("sbx shell") {
        return Some("needs a terminal");
    }
    None
}

/// `ID` as a word (not `$ID`, `RUN_ID` or `ID=`) replaced by `id`.
fn fill_id(line: &str, id: &str) -> String {
    let bytes = line.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < bytes.len() {
        let word_before = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || b"_$".contains(&bytes[i - 1]));
        let word_after = bytes.get(i + 2).is_some_and(|b| b.is_ascii_alphanumeric() || b"_=".contains(b));
        if line[i..].starts_with("ID") && !word_before && !word_after {
            out.push_str(id);
            i += 2;
        } else {
            let c = line[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The exit code a line asks for (`sh -c 'exit 3'`), else 0.
fn expected_code(line: &str) -> i32 {
    line.split("exit ").nth(1).and_then(|rest| rest.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()).unwrap_or(0)
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The block as a bash script: placeholders filled, each line checked for its exit code.
fn script(block: &Block, id: &str, daemon: &Daemon, bin_dir: &Path, skipped: &mut Vec<String>) -> String {
    let mut s = String::new();
    s.push_str(&format!("export PATH={}:$PATH\n", quote(&bin_dir.display().to_string())));
    s.push_str(&format!("export SANDBOXD_SOCKET={}\n", quote(&daemon.address)));
    s.push_str("unset SBX_AGENT_STATE_DIR OPENAI_BASE_URL OPENAI_API_KEY\n");
    s.push_str("some-producer() { printf 'a\\nx1\\nb\\nx2\\n'; }\n");
    s.push_str("trap 'kill $(jobs -p) 2>/dev/null' EXIT\n");
    for line in &block.lines {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if let Some(why) = skip_reason(block, line) {
            let command = trimmed.split("  #").next().unwrap_or_default().trim_end();
            skipped.push(format!("{}: {command} ({why})", block.file));
            continue;
        }
        // The reader's own socket is the test daemon's.
        let mut run = line.replace("unix://$PWD/.sandboxd/sandboxd.sock", &daemon.address).replace("target/quick/sbx", "sbx");
        run = fill_id(&run, id).replace("RUN_ID", "\"$(ls -t .sandboxd/agent/runs | head -n 1)\"");
        let code = expected_code(line);
        s.push_str(&format!("{run}\n"));
        if run.trim_end().split('#').next().unwrap_or_default().trim_end().ends_with('&') {
            // A server started in the background: the next line needs it listening.
            if let Some(port) = run.split("127.0.0.1:").nth(1).and_then(|p| p.get(..4)) {
                s.push_str(&format!("for _ in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.1; done\n"));
            }
            continue;
        }
        s.push_str(&format!(
            "rc=$?; if [ $rc -ne {code} ]; then echo {} \"exited $rc, not {code}\" >&2; exit 1; fi\n",
            quote(&format!("{} (block at line {}): {trimmed}:", block.file, block.line))
        ));
    }
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn every_sbx_example_in_the_readmes_runs_as_written() {
    let daemon = Daemon::start().await.expect("starting sandboxd");
    let client = daemon.client().await.expect("client");
    let work = tempfile::tempdir().expect("tempdir");
    let bin_dir = work.path().join("bin");
    std::fs::create_dir(&bin_dir).expect("bin dir");
    std::os::unix::fs::symlink(sbx_bin().expect("sbx built"), bin_dir.join("sbx")).expect("sbx on PATH");
    // What the cp examples expect to find: local files, and files in the sandbox.
    std::fs::write(work.path().join("big.iso"), vec![7u8; 3 << 20]).expect("big.iso");
    std::fs::create_dir_all(work.path().join("src/sub")).expect("src");
    std::fs::write(work.path().join("src/sub/main.c"), b"int main(void) { return 0; }\n").expect("src file");
    let sandbox = client.create(sandbox_tests::process_sandbox("debian")).await.expect("CreateSandbox");
    let id = sandbox.id;
    let setup = sandbox_tests::sh(&client, &id, "echo log > /workspace/out.log && mkdir -p /workspace/build && echo b > /workspace/build/b").await;
    sandbox_tests::assert_exited(&setup, 0);

    let mut skipped = Vec::new();
    let mut walked = 0;
    for block in sh_blocks("README.md").into_iter().chain(sh_blocks("agent-client/README.md")) {
        let text = script(&block, &id, &daemon, &bin_dir, &mut skipped);
        let out = tokio::process::Command::new("bash").arg("-c").arg(&text).current_dir(work.path()).kill_on_drop(true).output();
        let out = tokio::time::timeout(std::time::Duration::from_secs(300), out).await.expect("a README block ran for 5 minutes").expect("running bash");
        assert!(
            out.status.success(),
            "README block at {}:{} failed:\n{}\nstdout: {}\nstderr: {}",
            block.file,
            block.line,
            text,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if block.lines.iter().any(|l| l.contains("hello from")) {
            assert!(String::from_utf8_lossy(&out.stdout).contains("hello from sb-"), "the quickstart's hello: {}", String::from_utf8_lossy(&out.stdout));
        }
        walked += 1;
    }
    // What the cp examples did, seen from both sides.
    assert_eq!(std::fs::read(work.path().join("out.log")).expect("out.log copied out"), b"log\n");
    assert_eq!(std::fs::read(work.path().join("build/b")).expect("build/ copied out"), b"b\n");
    let listed = sandbox_tests::sh_ok(&client, &id, "ls -l /workspace/big.iso /workspace/src/sub/main.c").await;
    assert!(listed.contains("3145728"), "big.iso went in whole: {listed}");
    assert!(walked >= 4, "only {walked} README blocks were walked");
    let expected: Vec<String> = EXPECTED_SKIPS.iter().map(|s| s.to_string()).collect();
    assert_eq!(skipped, expected, "the README lines skipped changed: walk the new ones, or pin them here with their reason");
}
