// The operator's page. Everything shown comes from a sandbox or a tenant and is hostile: it only
// ever reaches the DOM as text (textContent, createTextNode), never as markup.
"use strict";

const state = { token: sessionStorage.getItem("sandboxd-token") || "", sandbox: "", run: "", trace: "", seen: "", overview: null, poll: null, actions: null };

// A token given as #token=… is kept for this tab and taken out of the address bar.
(function takeToken() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.has("token")) {
    state.token = params.get("token");
    sessionStorage.setItem("sandboxd-token", state.token);
    params.delete("token");
    history.replaceState(null, "", "#" + params.toString());
  }
  state.sandbox = params.get("sandbox") || "";
  state.run = params.get("run") || "";
  state.trace = params.get("trace") || "";
})();

function $(id) { return document.getElementById(id); }

// el("td", {class: "x"}, "text", otherNode): strings become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "onclick") node.addEventListener("click", v);
    else if (k === "dataset") { for (const [dk, dv] of Object.entries(v)) if (dv !== null && dv !== undefined) node.dataset[dk] = String(dv); }
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function replace(id, ...children) {
  const node = $(id);
  node.replaceChildren(...children.flat().filter((c) => c !== undefined && c !== null));
  return node;
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function age(seconds) {
  if (seconds < 60) return seconds + "s";
  if (seconds < 3600) return Math.floor(seconds / 60) + "m";
  if (seconds < 86400) return Math.floor(seconds / 3600) + "h" + Math.floor((seconds % 3600) / 60) + "m";
  return Math.floor(seconds / 86400) + "d";
}

function labels(map) {
  return Object.entries(map || {}).map(([k, v]) => el("span", { class: "tag" }, k + "=" + v));
}

function setHash() {
  // The long poll watches the old view: start another for this one.
  if (state.poll) state.poll.abort();
  const p = new URLSearchParams();
  if (state.sandbox) p.set("sandbox", state.sandbox);
  if (state.run) p.set("run", state.run);
  if (state.trace) p.set("trace", state.trace);
  history.replaceState(null, "", "#" + p.toString());
}

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options) {
  const headers = Object.assign({}, (options || {}).headers);
  if (state.token) headers.Authorization = "Bearer " + state.token;
  const resp = await fetch("/api/" + path, Object.assign({}, options, { headers, cache: "no-store" }));
  let body = null;
  try { body = await resp.json(); } catch (_) { body = null; }
  if (!resp.ok) throw new HttpError(resp.status, (body && body.error) || resp.statusText);
  return body;
}

function showError(e) {
  const box = $("error");
  if (!e) { box.hidden = true; return; }
  box.hidden = false;
  box.textContent = String(e.message || e);
  if (e.status === 401) $("token-form").hidden = false;
}

function renderOverview(o) {
  state.overview = o;
  replace("who", "tenant ", el("b", {}, o.tenant), " · v" + o.version + (o.allow_destroy ? " · destroy and agent-run actions allowed" : " · read-only"));
  replace("tiers", table(["Tier", "Health", "Allowed by policy", "Why not"], o.tiers.map((t) => el("tr", { dataset: { tier: t.tier } },
    el("td", {}, t.tier),
    el("td", { class: t.available ? "ok" : "bad" }, t.available ? "available" : "unavailable"),
    el("td", {}, t.allowed ? "yes" : "no"),
    el("td", { class: "muted" }, t.reason || "")))),
  el("p", { class: "muted" }, "Sandboxes held: " + o.sandboxes_held + (o.max_sandboxes ? " of " + o.max_sandboxes : "")));
  replace("metrics", table(["Metric", "Labels", "Value"], o.metrics.map((m) => el("tr", {}, el("td", { class: "mono" }, m.name), el("td", { class: "mono" }, m.labels), el("td", {}, m.value)))));
  if (o.fleet) {
    const metric = (n, name) => (n.status.metrics || []).filter((m) => m.name === name).reduce((sum, m) => sum + m.value, 0);
    replace("fleet", el("h3", {}, "Fleet nodes"), table(["Node", "Address", "Ready", "Tiers", "Sandboxes", "Execs", "OOM kills", "Timeouts"], o.fleet.map((n) => el("tr", { dataset: { node: n.node, unreachable: n.unreachable ? "yes" : null } },
      el("td", {}, n.node + (n.self ? " (this one)" : "")), el("td", { class: "mono" }, n.address),
      el("td", { class: n.error ? "bad" : "" }, n.error ? "unreachable: " + n.error : (n.status.ready ? "yes" : "no (draining)")),
      el("td", {}, n.status ? n.status.tiers.map((t) => el("span", { class: "tag" }, t.tier + (t.available ? " ✓ " + t.free_sandboxes + " free" : " ✗"))) : ""),
      el("td", {}, n.status ? n.status.sandboxes_held : "—"),
      el("td", {}, n.status ? metric(n, "sandboxd_execs_total") : "—"),
      el("td", {}, n.status ? metric(n, "sandboxd_oom_kills_total") : "—"),
      el("td", {}, n.status ? metric(n, "sandboxd_exec_timeouts_total") : "—")))));
  }
  $("runs-section").hidden = !o.agent_runs;
}

function renderSandboxes(answer) {
  const list = answer.sandboxes;
  const fleet = list.some((s) => s.node);
  // A node that did not answer: its sandboxes are missing from the list, and the list says so.
  const missing = answer.unreachable_nodes.map((n) => el("p", { class: "bad unreachable", dataset: { node: n.node } }, "Node " + n.node + " (" + n.address + ") unreachable: its sandboxes are not listed (" + n.error + ")"));
  if (!list.length) { replace("sandboxes", missing, el("p", { class: "muted" }, "No sandboxes.")); return; }
  const groups = new Map();
  for (const s of list) {
    const key = s.isolation + " · " + s.state;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(s);
  }
  const out = [];
  for (const [key, items] of [...groups.entries()].sort()) {
    out.push(el("h3", {}, key + " (" + items.length + ")"));
    const local = (s) => !s.node || (state.overview && state.overview.fleet && state.overview.fleet.some((n) => n.self && n.node === s.node));
    out.push(table(["Id"].concat(fleet ? ["Node"] : [], ["Image", "Limits", "Labels", "Policy", "Age"]), items.map((s) => el("tr", { dataset: { sandboxId: s.id, node: s.node || null } },
      // A sandbox of another node is shown on that node's own page.
      el("td", {}, local(s) ? el("a", { class: "mono", onclick: () => select(s.id) }, s.id) : el("span", { class: "mono", title: "on node " + s.node + ": its details are on that node's page" }, s.id)),
      fleet ? el("td", {}, s.node) : null,
      el("td", {}, s.image),
      el("td", {}, (s.limits.cpu_millicores / 1000) + " cpu · " + bytes(s.limits.memory_bytes) + " · " + s.limits.max_pids + " pids · " + bytes(s.limits.disk_bytes)),
      el("td", {}, labels(s.labels)),
      el("td", { class: "muted" }, s.isolation_reason || s.failure_reason || ""),
      el("td", {}, age(s.age_seconds))))));
  }
  replace("sandboxes", missing, out);
}

function statusClass(status) {
  if (status === "running") return "running";
  return status === "exited" ? "ok" : "bad";
}

function traceLink(e) {
  if (!e.trace_id) return "";
  const template = state.overview && state.overview.trace_url;
  const attrs = { class: "mono", title: "span " + e.span_id, dataset: { traceId: e.trace_id } };
  if (template) {
    attrs.href = template.replace("{trace_id}", encodeURIComponent(e.trace_id));
    attrs.target = "_blank";
    attrs.rel = "noopener noreferrer";
    return el("a", attrs, e.trace_id.slice(0, 16) + "…");
  }
  attrs.onclick = () => { state.trace = state.trace === e.trace_id ? "" : e.trace_id; setHash(); refresh(); };
  return el("a", attrs, e.trace_id.slice(0, 16) + "…");
}

function renderSandbox(s) {
  $("sandbox-section").hidden = false;
  replace("sandbox-title", el("span", { class: "mono" }, s.id));
  const info = table(["Tier", "State", "Image", "Created", "Expires", "Usage now"], [el("tr", {},
    el("td", {}, s.isolation + (s.isolation_reason ? " (" + s.isolation_reason + ")" : "")),
    el("td", {}, s.state + (s.failure_reason ? ": " + s.failure_reason : "")),
    el("td", {}, s.image),
    el("td", {}, s.created_at),
    el("td", {}, s.expires_at || "never"),
    el("td", {}, s.usage ? ((s.usage.cpu_user_ms + s.usage.cpu_system_ms) + " ms cpu · " + bytes(s.usage.memory_bytes) + " mem (peak " + bytes(s.usage.peak_memory_bytes) + ")") : "—"))]);
  const execs = state.trace ? s.execs.filter((e) => e.trace_id === state.trace) : s.execs;
  const filter = state.trace ? el("p", {}, "Execs of trace ", el("code", {}, state.trace), " ", el("a", { onclick: () => { state.trace = ""; setHash(); refresh(); } }, "(show all)")) : null;
  const rows = execs.map((e) => el("tr", { dataset: { execId: e.exec_id, status: e.status } },
    el("td", {}, el("a", { class: "mono", onclick: () => showOutput(e.exec_id) }, e.exec_id)),
    el("td", { class: "mono argv" }, JSON.stringify(e.argv) + (e.argv_truncated ? " …" : "")),
    el("td", { class: statusClass(e.status) + " status" }, e.status + (e.error ? ": " + e.error : "")),
    el("td", { class: "exit-code" }, e.status === "running" ? "" : e.exit_code),
    el("td", {}, e.duration_ms + " ms"),
    el("td", {}, (e.cpu_user_ms + e.cpu_system_ms) + " ms"),
    el("td", {}, bytes(e.peak_memory_bytes)),
    el("td", {}, [e.stdout_truncated ? "stdout cut" : "", e.stderr_truncated ? "stderr cut" : "", e.output_discarded ? "output dropped" : ""].filter(Boolean).join(", ")),
    el("td", {}, traceLink(e))));
  const snaps = s.snapshots.length ? table(["Snapshot", "Name", "Created", "Size", "Memory"], s.snapshots.map((p) => el("tr", {},
    el("td", { class: "mono" }, p.snapshot_id), el("td", {}, p.name), el("td", {}, p.created_at), el("td", {}, bytes(p.size_bytes)), el("td", {}, p.memory ? "yes" : "no"))))
    : el("p", { class: "muted" }, "No snapshots.");
  const destroy = state.overview && state.overview.allow_destroy && s.state !== "destroyed"
    ? el("p", {}, el("button", { id: "destroy", onclick: () => destroySandbox(s.id) }, "Destroy this sandbox")) : null;
  replace("sandbox", info, el("p", {}, labels(s.labels)), destroy,
    el("h3", {}, "Exec records (newest first)"), filter,
    execs.length ? table(["Exec", "Argv", "Status", "Exit", "Duration", "CPU", "Peak memory", "Truncated", "Trace"], rows) : el("p", { class: "muted" }, "No execs."),
    el("h3", {}, "Snapshots"), snaps);
}

async function showOutput(execId) {
  try {
    const r = await api("execs/" + encodeURIComponent(execId) + "/output");
    $("output-section").hidden = false;
    replace("output-title", el("span", { class: "mono" }, execId));
    const stream = (name, s, total, cut) => [
      el("h3", {}, name + " (" + bytes(total) + " written" + (cut ? ", record truncated" : "") + ")"),
      el("pre", { class: name }, s.head),
      s.tail !== null ? [el("p", { class: "muted" }, "… " + bytes(s.kept_bytes - 2 * s.head.length) + " not shown …"), el("pre", { class: name + "-tail" }, s.tail)] : null,
    ];
    replace("output", el("p", { class: "mono" }, JSON.stringify(r.argv)), stream("stdout", r.stdout, r.stdout_total_bytes, r.stdout_truncated), stream("stderr", r.stderr, r.stderr_total_bytes, r.stderr_truncated));
  } catch (e) { showError(e); }
}

async function destroySandbox(id) {
  if (!confirm("Destroy sandbox " + id + "?")) return;
  try {
    await api("sandboxes/" + encodeURIComponent(id) + "/destroy", { method: "POST", headers: { "X-Sandboxd-Web": "destroy" } });
    state.sandbox = "";
    setHash();
    $("sandbox-section").hidden = true;
    refresh();
  } catch (e) { showError(e); }
}

function renderImages(list) {
  replace("images", table(["Name", "Size", "Ready tiers", "Source", "Created", "Digest"], list.map((i) => el("tr", {},
    el("td", {}, i.name), el("td", {}, bytes(i.size_bytes)), el("td", {}, i.ready_tiers.map((t) => el("span", { class: "tag" }, t))),
    el("td", { class: "muted" }, i.source), el("td", {}, i.created_at), el("td", { class: "mono" }, i.digest.slice(0, 19))))));
}

function renderRuns(list) {
  replace("runs", list.length ? table(["Run", "Task", "State", "Status", "Steps", "Tokens", "Sandbox"], list.map((r) => el("tr", { dataset: { runId: r.run_id } },
    el("td", {}, el("a", { class: "mono", onclick: () => { state.run = r.run_id; setHash(); refresh(); } }, r.run_id)),
    el("td", {}, r.error ? el("span", { class: "bad" }, r.error) : (r.task || "")),
    el("td", {}, r.state || ""), el("td", {}, r.status ? r.status + " (" + r.reason + ")" : "running"),
    el("td", {}, r.steps), el("td", {}, r.prompt_tokens + r.completion_tokens),
    el("td", {}, r.sandbox_id ? el("a", { class: "mono", onclick: () => select(r.sandbox_id) }, r.sandbox_id) : ""))))
    : el("p", { class: "muted" }, "No runs."));
}

function eventDetail(e) {
  switch (e.event) {
    case "step": return [e.action, " → ", e.result || "", e.exit_code !== undefined ? " (exit " + e.exit_code + ")" : "", e.exec_id ? el("a", { class: "mono", onclick: () => showOutput(e.exec_id) }, " observation") : ""];
    case "llm_call": return (e.purpose || "step") + ": " + (e.prompt_tokens || 0) + " prompt + " + (e.completion_tokens || 0) + " completion tokens, " + (e.latency_ms || 0) + " ms" + (e.error ? " — " + e.error : "");
    case "verify": return (e.passed ? "passed" : "FAILED") + " " + (e.level || "") + ": " + (e.command || "") + (e.actual ? " — " + e.actual : "");
    case "transition": return e.from + " → " + e.to + (e.why ? " (" + e.why + ")" : "");
    case "stop": return e.status + " (" + e.reason + ")" + (e.detail ? ": " + e.detail : "");
    case "decision": return e.decision + (e.detail ? ": " + e.detail : "");
    case "action": return e.action;
    case "start": return e.task;
    case "operator": return e.decision + (e.detail ? ": " + e.detail : "");
    default: return JSON.stringify(Object.fromEntries(Object.entries(e).filter(([k]) => !["ts_ms", "trace_id", "run_id", "session", "step", "state", "event"].includes(k))));
  }
}

function renderRun(r) {
  const t0 = r.events.length ? r.events[0].ts_ms : 0;
  const b = r.budget || {};
  const used = b.used || {};
  replace("run", el("h3", {}, "Run ", el("span", { class: "mono" }, r.run_id), r.trace_id ? [" · trace ", el("code", {}, r.trace_id)] : ""),
    el("p", {}, "Task: ", r.task || "", el("br"), "State: " + (r.state || "") + (r.outcome ? " · outcome " + r.outcome.reason + ": " + (r.outcome.summary || "") : "")),
    el("p", {}, "Budget: " + r.steps + " of " + (b.max_steps || "?") + " steps · " + ((used.prompt_tokens || 0) + (used.completion_tokens || 0)) + " tokens" + (b.max_tokens ? " of " + b.max_tokens : "") + (b.verify ? " · verify: " + b.verify : "")),
    r.checkpoint_error ? el("p", { class: "bad" }, "Checkpoint: " + r.checkpoint_error) : null,
    table(["T+s", "Step", "State", "Event", "Detail"], r.events.map((e) => el("tr", { dataset: { event: e.event } },
      el("td", {}, ((e.ts_ms - t0) / 1000).toFixed(1)), el("td", {}, e.step), el("td", {}, e.state), el("td", {}, e.event), el("td", {}, eventDetail(e))))),
    runActions(r),
    el("h3", {}, "Final diff"), r.diff ? el("pre", {}, r.diff) : el("p", { class: "muted" }, "None (yet)."));
}

// Steer and stop, on a run that still takes requests, when the page may act. The controls are
// made once per run and kept across the live updates, so what the operator types survives them.
function runActions(r) {
  if (!(state.overview && state.overview.allow_agent_actions && r.takes_requests)) return null;
  if (!state.actions || state.actions.run !== r.run_id) {
    const message = el("textarea", { id: "steer-message", rows: 2, cols: 70, maxlength: 4000, placeholder: "A correction for the model: it reads it before its next step" });
    const reason = el("input", { id: "stop-reason", type: "text", size: 50, maxlength: 1000, placeholder: "Why (recorded in the run's outcome)" });
    const result = el("p", { id: "run-action-result", class: "muted" });
    const send = async (kind, body) => {
      try {
        const sent = await api("runs/" + encodeURIComponent(r.run_id) + "/" + kind, { method: "POST", headers: { "X-Sandboxd-Web": "agent", "Content-Type": "application/json" }, body: JSON.stringify(body) });
        result.className = "ok";
        result.dataset.requestId = sent.request_id;
        result.textContent = kind + " " + sent.request_id + " sent: the run takes it at its next step boundary";
        if (kind === "steer") message.value = "";
      } catch (e) {
        result.className = "bad";
        result.textContent = kind + " refused: " + e.message;
      }
    };
    state.actions = { run: r.run_id, node: el("div", { id: "run-actions" },
      el("h3", {}, "Operator"),
      el("p", {}, message, " ", el("button", { id: "steer", onclick: () => send("steer", { message: message.value }) }, "Steer")),
      el("p", {}, reason, " ", el("button", { id: "stop-done", onclick: () => send("stop", { status: "done", reason: reason.value }) }, "Stop (done)"),
        " ", el("button", { id: "stop-failed", onclick: () => send("stop", { status: "failed", reason: reason.value }) }, "Stop (failed)")),
      result) };
  }
  return state.actions.node;
}

function select(id) {
  state.sandbox = id;
  state.trace = "";
  setHash();
  refresh();
}

async function refresh() {
  try {
    const [overview, sandboxes, images] = await Promise.all([api("overview"), api("sandboxes"), api("images")]);
    renderOverview(overview);
    renderSandboxes(sandboxes);
    renderImages(images);
    if (state.sandbox) {
      try { renderSandbox(await api("sandboxes/" + encodeURIComponent(state.sandbox))); } catch (e) {
        if (e.status !== 404) throw e;
        state.sandbox = ""; setHash(); $("sandbox-section").hidden = true;
      }
    }
    if (overview.agent_runs) {
      renderRuns(await api("runs"));
      if (state.run) renderRun(await api("runs/" + encodeURIComponent(state.run)));
    }
    showError(null);
  } catch (e) { showError(e); }
}

// Live updates: a long poll that answers when what this view shows has changed.
async function live() {
  for (;;) {
    state.poll = new AbortController();
    try {
      const r = await api("wait?sandbox=" + encodeURIComponent(state.sandbox) + "&run=" + encodeURIComponent(state.run) + "&seen=" + encodeURIComponent(state.seen), { signal: state.poll.signal });
      $("live").textContent = "live";
      if (r.changed) {
        state.seen = r.fingerprint;
        await refresh();
      }
    } catch (e) {
      if (e.name === "AbortError") { state.seen = ""; continue; }
      $("live").textContent = "reconnecting…";
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }
}

$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.token = $("token").value;
  sessionStorage.setItem("sandboxd-token", state.token);
  $("token-form").hidden = true;
  state.seen = "";
  refresh();
});

refresh().then(live);
