//! A real headless Chromium driven over the DevTools protocol on `--remote-debugging-pipe`: the
//! browser reads commands (JSON, NUL-terminated) on its fd 3 and writes answers and events on
//! its fd 4, so no port, WebSocket or crate is needed. Waiting for something on the page is a
//! promise the page itself resolves from a `MutationObserver` ([`Page::wait_for`]): the test
//! waits for the DOM to change, never for a fixed time.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

/// The Chromium binary: `$CHROMIUM`, else `chromium` (Debian's package) on the PATH.
pub fn chromium_bin() -> String {
    std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into())
}

/// A headless Chromium process, ended when dropped.
pub struct Browser {
    child: Child,
    commands: std::fs::File,
    messages: mpsc::Receiver<Value>,
    /// Events read while waiting for an answer, kept for [`Browser::wait_event`].
    events: Vec<Value>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

/// One tab, attached with its own DevTools session.
pub struct Page<'a> {
    browser: &'a mut Browser,
    session: String,
}

impl Browser {
    /// Starts Chromium (headless, a fresh profile, a 1280×1000 window). Fails, saying so, when
    /// Chromium is not installed (`make deps` installs Debian's `chromium`).
    pub fn start() -> Result<Browser> {
        let profile = tempfile::Builder::new().prefix("sandboxd-chromium-").tempdir().context("creating a profile dir")?;
        // Ours: commands go in `to_browser`, answers come out of `from_browser`.
        let (cmd_read, cmd_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("pipe")?;
        let (out_read, out_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("pipe")?;
        let (child_in, child_out) = (cmd_read.as_raw_fd(), out_write.as_raw_fd());
        let mut cmd = Command::new(chromium_bin());
        cmd.args([
            "--headless",
            "--remote-debugging-pipe",
            // Root (as the tests run) cannot use Chromium's own sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--window-size=1280,1000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: only fcntl and dup2, async-signal-safe, between fork and exec. The ends are
        // first copied above fd 10 so that neither dup2 overwrites the other's source.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(move || {
                let a = libc::fcntl(child_in, libc::F_DUPFD, 10);
                let b = libc::fcntl(child_out, libc::F_DUPFD, 10);
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {} (install Debian's `chromium`: make deps)", chromium_bin()))?;
        drop((cmd_read, out_write));
        let (tx, messages) = mpsc::channel();
        let reader: OwnedFd = out_read;
        std::thread::spawn(move || {
            let mut reader = BufReader::new(std::fs::File::from(reader));
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if buf.last() == Some(&0) {
                            buf.pop();
                        }
                        if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                            if tx.send(v).is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
        Ok(Browser { child, commands: std::fs::File::from(cmd_write), messages, events: Vec::new(), next_id: 1, _profile: profile })
    }

    /// Sends a command (on a tab's `session`, or to the browser) and returns its result.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value, within: Duration) -> Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg)?;
        bytes.push(0);
        self.commands.write_all(&bytes).with_context(|| format!("sending {method} to Chromium"))?;
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self.messages.recv_timeout(left).map_err(|_| anyhow!("Chromium did not answer {method} within {within:?}"))?;
            if m["id"].as_u64() == Some(id) {
                if let Some(e) = m.get("error") {
                    bail!("{method} failed: {e}");
                }
                return Ok(m["result"].clone());
            }
            if m.get("method").is_some() {
                self.events.push(m);
            }
        }
    }

    /// Waits for an event `method` on `session`.
    fn wait_event(&mut self, session: &str, method: &str, within: Duration) -> Result<Value> {
        let is_it = |m: &Value| m["method"] == method && m["sessionId"] == session;
        if let Some(i) = self.events.iter().position(is_it) {
            return Ok(self.events.remove(i));
        }
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self.messages.recv_timeout(left).map_err(|_| anyhow!("no {method} event within {within:?}"))?;
            if is_it(&m) {
                return Ok(m);
            }
        }
    }

    /// Opens `url` in a new tab and waits for its load event.
    pub fn open(&mut self, url: &str) -> Result<Page<'_>> {
        let t = Duration::from_secs(30);
        let target = self.call(None, "Target.createTarget", json!({ "url": "about:blank" }), t)?;
        let target_id = target["targetId"].as_str().ok_or_else(|| anyhow!("no targetId in {target}"))?.to_string();
        let attached = self.call(None, "Target.attachToTarget", json!({ "targetId": target_id, "flatten": true }), t)?;
        let session = attached["sessionId"].as_str().ok_or_else(|| anyhow!("no sessionId in {attached}"))?.to_string();
        self.call(Some(&session), "Page.enable", json!({}), t)?;
        self.call(Some(&session), "Page.navigate", json!({ "url": url }), t)?;
        self.wait_event(&session, "Page.loadEventFired", t)?;
        Ok(Page { browser: self, session })
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Page<'_> {
    /// Evaluates `expression` in the page (awaiting it when it is a promise) and returns its
    /// value; a thrown error or rejected promise is an error carrying its message.
    pub fn eval(&mut self, expression: &str, within: Duration) -> Result<Value> {
        let r = self.browser.call(
            Some(&self.session.clone()),
            "Runtime.evaluate",
            json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            within + Duration::from_secs(5),
        )?;
        if let Some(e) = r.get("exceptionDetails") {
            let text = e["exception"]["description"].as_str().or(e["text"].as_str()).unwrap_or("exception");
            bail!("{text}");
        }
        Ok(r["result"]["value"].clone())
    }

    /// Waits until an element matching `selector` whose text contains `text` is on the page, and
    /// returns its text. The page resolves the wait itself from a `MutationObserver`; past
    /// `within` the error carries what the page showed.
    pub fn wait_for(&mut self, selector: &str, text: &str, within: Duration) -> Result<String> {
        let js = format!(
            r#"new Promise((resolve, reject) => {{
                const sel = {sel}, want = {text};
                const find = () => {{ for (const n of document.querySelectorAll(sel)) {{ if (n.textContent.includes(want)) return n.textContent; }} return null; }};
                const now = find();
                if (now !== null) return resolve(now);
                const obs = new MutationObserver(() => {{ const t = find(); if (t !== null) {{ obs.disconnect(); clearTimeout(timer); resolve(t); }} }});
                obs.observe(document.documentElement, {{ subtree: true, childList: true, characterData: true, attributes: true }});
                const timer = setTimeout(() => {{ obs.disconnect(); reject(new Error("no " + sel + " with " + JSON.stringify(want) + " within {ms} ms; the page shows: " + document.body.innerText.slice(0, 3000))); }}, {ms});
            }})"#,
            sel = json!(selector),
            text = json!(text),
            ms = within.as_millis()
        );
        let v = self.eval(&js, within)?;
        Ok(v.as_str().unwrap_or_default().to_string())
    }

    /// A PNG of the page as it is now.
    pub fn screenshot(&mut self) -> Result<Vec<u8>> {
        use base64::Engine;
        let r = self.browser.call(
            Some(&self.session.clone()),
            "Page.captureScreenshot",
            json!({ "format": "png", "captureBeyondViewport": true }),
            Duration::from_secs(30),
        )?;
        let data = r["data"].as_str().ok_or_else(|| anyhow!("no screenshot data"))?;
        base64::engine::general_purpose::STANDARD.decode(data).context("decoding the screenshot")
    }
}
