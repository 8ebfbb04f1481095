//! A scripted stand-in for an OpenAI-compatible model, for tests and benchmarks.
//!
//! [`FixtureServer`] serves `POST /v1/chat/completions` on `127.0.0.1:<any port>` over real
//! HTTP, so the client code under test is the production one. Each request that offers tools is
//! a turn of the [`Script`]; a request without tools is a summarization and gets a short
//! deterministic summary. [`ScriptedLlm`] plays the same script in-process, for unit tests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::llm::{classify_http, parse_response, ChatRequest, ChatResponse, LlmError, LlmProvider};
use super::tokens::estimate;

/// What the fixture errors with.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    /// Cannot listen.
    #[error("fixture server cannot listen: {0}")]
    Bind(#[from] std::io::Error),
}

/// One scripted answer.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A tool call with raw (possibly malformed) argument text.
    Call {
        /// Tool name as the model writes it.
        name: String,
        /// Argument text as the model writes it.
        arguments: String,
    },
    /// A plain text answer, no tool call.
    Text(String),
    /// An HTTP error.
    Status {
        /// The status code.
        code: u16,
        /// The body.
        body: String,
        /// `Retry-After` seconds.
        retry_after: Option<u64>,
    },
    /// Wait, then answer.
    Delay(Duration, Box<Reply>),
    /// The reply as a model cut off by its completion limit sends it: `finish_reason: "length"`.
    Cut(Box<Reply>),
    /// Text written alongside the reply (the model's reasoning next to its tool call).
    Say(String, Box<Reply>),
    /// The reply with these token counts in its `usage` (an endpoint that miscounts).
    Usage {
        /// `usage.prompt_tokens`.
        prompt: u64,
        /// `usage.completion_tokens`.
        completion: u64,
        /// The reply.
        reply: Box<Reply>,
    },
}

impl Reply {
    /// `bash(command)`.
    pub fn bash(command: &str) -> Self {
        Self::call("bash", json!({ "command": command }))
    }

    /// `finish(answer)`.
    pub fn finish(answer: &str) -> Self {
        Self::call("finish", json!({ "answer": answer }))
    }

    /// A well-formed call.
    pub fn call(name: &str, args: Value) -> Self {
        Reply::Call {
            name: name.into(),
            arguments: args.to_string(),
        }
    }

    /// This reply, cut off by the completion limit (`finish_reason: "length"`).
    pub fn cut(self) -> Self {
        Reply::Cut(Box::new(self))
    }

    /// This reply with `text` written alongside it.
    pub fn saying(self, text: &str) -> Self {
        Reply::Say(text.into(), Box::new(self))
    }

    /// This reply, reporting `prompt` and `completion` tokens used.
    pub fn with_usage(self, prompt: u64, completion: u64) -> Self {
        Reply::Usage {
            prompt,
            completion,
            reply: Box::new(self),
        }
    }

    /// A call with the argument text exactly as given.
    pub fn raw(name: &str, arguments: &str) -> Self {
        Reply::Call {
            name: name.into(),
            arguments: arguments.into(),
        }
    }
}

/// What the script sees of a turn.
#[derive(Clone, Debug)]
pub struct Turn {
    /// 0-based index of this turn (summarization requests not counted).
    pub index: usize,
    /// The request body.
    pub request: Value,
}

impl Turn {
    /// The text of the last tool or user message (the latest observation).
    pub fn last_result(&self) -> String {
        self.request["messages"]
            .as_array()
            .and_then(|m| {
                m.iter()
                    .rev()
                    .find(|m| m["role"] == "tool")
                    .and_then(|m| m["content"].as_str())
            })
            .unwrap_or_default()
            .to_owned()
    }
}

type TurnFn = dyn Fn(&Turn) -> Reply + Send + Sync;

/// The scripted behaviour of the model.
#[derive(Clone)]
pub struct Script {
    turn: Arc<TurnFn>,
    context_limit: Option<usize>,
}

impl Script {
    /// Plays `replies` in order; after the last one, answers `finish("script exhausted")`.
    pub fn sequence(replies: Vec<Reply>) -> Self {
        Script {
            turn: Arc::new(move |t: &Turn| {
                replies
                    .get(t.index)
                    .cloned()
                    .unwrap_or_else(|| Reply::finish("script exhausted"))
            }),
            context_limit: None,
        }
    }

    /// Refuses, as a real endpoint does (HTTP 400 `context_length_exceeded`), any request
    /// whose prompt is estimated above `tokens` (4 characters a token).
    pub fn with_context_limit(mut self, tokens: usize) -> Self {
        self.context_limit = Some(tokens);
        self
    }

    /// Answers each turn with `f`.
    pub fn from_fn(f: impl Fn(&Turn) -> Reply + Send + Sync + 'static) -> Self {
        Script {
            turn: Arc::new(f),
            context_limit: None,
        }
    }

    fn reply(&self, turn: &Turn) -> Reply {
        (self.turn)(turn)
    }
}

/// A short summary of a summarization request: the step lines it was given, condensed.
fn summarize(request: &Value) -> String {
    let input = request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let steps: Vec<&str> = input.lines().filter(|l| l.starts_with("step ")).collect();
    let first = steps
        .first()
        .map_or("", |l| l.split(':').next().unwrap_or(""));
    let last = steps
        .last()
        .map_or("", |l| l.split(':').next().unwrap_or(""));
    format!(
        "Summary ({first} to {last}): {} actions were taken; the most recent was {}.",
        steps.len(),
        steps
            .last()
            .map(|l| l.chars().take(120).collect::<String>())
            .unwrap_or_default()
    )
}

/// Builds the chat completion body for a reply; `None` for an HTTP error.
fn completion(
    reply: &Reply,
    request: &Value,
    index: usize,
) -> Result<Value, (u16, String, Option<u64>)> {
    let prompt_chars: usize = request["messages"]
        .as_array()
        .map(|m| m.iter().map(|m| m.to_string().len()).sum())
        .unwrap_or(0)
        + request["tools"].to_string().len();
    let (message, finish, completion_text) = match reply {
        Reply::Call { name, arguments } => (
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "id": format!("call_{index}"),
                    "type": "function",
                    "function": { "name": name, "arguments": arguments }
                }]
            }),
            "tool_calls",
            format!("{name}{arguments}"),
        ),
        Reply::Text(text) => (
            json!({ "role": "assistant", "content": text }),
            "stop",
            text.clone(),
        ),
        Reply::Status {
            code,
            body,
            retry_after,
        } => return Err((*code, body.clone(), *retry_after)),
        Reply::Delay(_, inner) => return completion(inner, request, index),
        Reply::Cut(inner) => {
            let mut body = completion(inner, request, index)?;
            body["choices"][0]["finish_reason"] = json!("length");
            return Ok(body);
        }
        Reply::Say(text, inner) => {
            let mut body = completion(inner, request, index)?;
            body["choices"][0]["message"]["content"] = json!(text);
            return Ok(body);
        }
        Reply::Usage {
            prompt,
            completion: used,
            reply,
        } => {
            let mut body = completion(reply, request, index)?;
            body["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": used});
            return Ok(body);
        }
    };
    Ok(json!({
        "id": format!("chatcmpl-{index}"),
        "object": "chat.completion",
        "model": request["model"],
        "choices": [{ "index": 0, "message": message, "finish_reason": finish }],
        "usage": {
            "prompt_tokens": prompt_chars.div_ceil(4),
            "completion_tokens": estimate(&completion_text).max(1),
        }
    }))
}

#[derive(Clone)]
struct ServerState {
    script: Script,
    turns: Arc<AtomicUsize>,
    summaries: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<Value>>>,
}

/// The scripted model on a local port.
pub struct FixtureServer {
    /// `http://127.0.0.1:<port>/v1`, for `OPENAI_BASE_URL`.
    pub base_url: String,
    state: ServerState,
    task: tokio::task::JoinHandle<()>,
}

impl FixtureServer {
    /// Starts serving `script` on `127.0.0.1` on a free port.
    pub async fn start(script: Script) -> Result<Self, FixtureError> {
        Self::start_on(
            "127.0.0.1:0".parse().map_err(std::io::Error::other)?,
            script,
        )
        .await
    }

    /// Starts serving `script` on `addr` (port 0: any free one; see [`FixtureServer::base_url`]).
    pub async fn start_on(
        addr: std::net::SocketAddr,
        script: Script,
    ) -> Result<Self, FixtureError> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = ServerState {
            script,
            turns: Arc::new(AtomicUsize::new(0)),
            summaries: Arc::new(AtomicUsize::new(0)),
            log: Arc::new(Mutex::new(Vec::new())),
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(handle))
            .route("/chat/completions", post(handle))
            .route("/v1/models", get(models))
            .route("/models", get(models))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "fixture server stopped");
            }
        });
        Ok(FixtureServer {
            base_url: format!("http://{addr}/v1"),
            state,
            task,
        })
    }

    /// Tool-offering requests served so far.
    pub fn turns(&self) -> usize {
        self.state.turns.load(Ordering::SeqCst)
    }

    /// Summarization requests served so far.
    pub fn summaries(&self) -> usize {
        self.state.summaries.load(Ordering::SeqCst)
    }

    /// Every request body received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.state.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for FixtureServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The HTTP 400 a real endpoint answers to a prompt over the script's context limit (4
/// characters a token), if this one is.
fn over_limit(script: &Script, request: &Value) -> Option<Value> {
    let limit = script.context_limit?;
    let chars = request["messages"].to_string().len() + request["tools"].to_string().len();
    (chars / 4 > limit).then(|| {
        json!({"error": {
            "message": format!("This model's maximum context length is {limit} tokens. However, your messages resulted in {} tokens.", chars / 4),
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }})
    })
}

/// `GET /v1/models`, as OpenAI-compatible servers answer it (what `sbx agent` probes first).
async fn models() -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": DEMO_MODEL, "object": "model", "owned_by": "sandboxd-fixture" }]
    }))
}

/// The model name the demo answers to (any name is accepted).
pub const DEMO_MODEL: &str = "sbx-demo";

/// The script of `sbx agent demo-model`: a few real steps in the sandbox (look around, write a
/// file, check it), then `finish`. The step is read from the request (the number of tool
/// results the model has seen), so every run against one server plays the whole script.
pub fn demo() -> Script {
    Script::from_fn(|turn: &Turn| {
        let seen = turn.request["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        match seen {
            0 => Reply::bash("uname -sr; id; pwd; ls -la")
                .saying("The demo model looks around the sandbox first."),
            1 => Reply::bash("printf 'written by the sbx demo model\\n' > demo.txt && cat demo.txt")
                .saying("Now it writes a file."),
            2 => Reply::bash("wc -c demo.txt && ls -la demo.txt")
                .saying("And checks the file is there."),
            _ => Reply::finish(
                "demo finished: looked around, wrote /workspace/demo.txt and checked it (a scripted model, not an AI)",
            ),
        }
    })
}

async fn handle(State(state): State<ServerState>, Json(request): Json<Value>) -> Response {
    if let Ok(mut log) = state.log.lock() {
        log.push(request.clone());
    }
    if let Some(body) = over_limit(&state.script, &request) {
        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
    }
    let offers_tools = request["tools"].as_array().is_some_and(|t| !t.is_empty());
    if !offers_tools {
        let index = state.summaries.fetch_add(1, Ordering::SeqCst);
        let reply = Reply::Text(summarize(&request));
        return match completion(&reply, &request, index) {
            Ok(body) => Json(body).into_response(),
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        };
    }
    let index = state.turns.fetch_add(1, Ordering::SeqCst);
    let turn = Turn {
        index,
        request: request.clone(),
    };
    let mut reply = state.script.reply(&turn);
    while let Reply::Delay(d, inner) = reply {
        tokio::time::sleep(d).await;
        reply = *inner;
    }
    match completion(&reply, &request, index) {
        Ok(body) => Json(body).into_response(),
        Err((code, body, retry_after)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp = (status, body).into_response();
            if let Some(secs) = retry_after {
                if let Ok(v) = secs.to_string().parse() {
                    resp.headers_mut().insert("retry-after", v);
                }
            }
            resp
        }
    }
}

/// The script played in-process, through the same response parsing as the HTTP provider.
pub struct ScriptedLlm {
    script: Script,
    turns: AtomicUsize,
    model: String,
    /// Every request, as the HTTP provider would have sent it.
    pub log: Mutex<Vec<Value>>,
}

impl ScriptedLlm {
    /// A provider playing `script` as model `model`.
    pub fn new(script: Script, model: &str) -> Self {
        ScriptedLlm {
            script,
            turns: AtomicUsize::new(0),
            model: model.into(),
            log: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait]
impl LlmProvider for ScriptedLlm {
    fn model(&self) -> &str {
        &self.model
    }

    async fn complete(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let body = json!({
            "model": self.model,
            "messages": request.messages,
            "tools": request.tools,
            "max_tokens": request.max_tokens,
        });
        if let Ok(mut log) = self.log.lock() {
            log.push(body.clone());
        }
        // The same refusal, parsed as the HTTP provider parses it.
        if let Some(refusal) = over_limit(&self.script, &body) {
            classify_http(400, &refusal.to_string(), None)?;
        }
        let reply = if request.tools.is_empty() {
            Reply::Text(summarize(&body))
        } else {
            let index = self.turns.fetch_add(1, Ordering::SeqCst);
            self.script.reply(&Turn {
                index,
                request: body.clone(),
            })
        };
        let mut reply = reply;
        while let Reply::Delay(d, inner) = reply {
            tokio::time::sleep(d).await;
            reply = *inner;
        }
        match completion(&reply, &body, 0) {
            Ok(v) => parse_response(&v.to_string()),
            // The HTTP provider's own mapping of statuses to errors.
            Err((code, text, retry_after)) => {
                match classify_http(code, &text, retry_after.map(Duration::from_secs)) {
                    Err(e) => Err(e),
                    Ok(()) => Err(LlmError::Fatal(format!("HTTP {code}: {text}"))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::llm::{Message, OpenAiProvider};

    #[tokio::test]
    async fn serves_scripted_turns_over_http() {
        let server = FixtureServer::start(Script::sequence(vec![
            Reply::bash("ls"),
            Reply::Status {
                code: 429,
                body: "slow down".into(),
                retry_after: Some(1),
            },
            Reply::finish("done"),
        ]))
        .await
        .expect("start");
        let p = OpenAiProvider::new(
            &server.base_url,
            Some("k".into()),
            "gpt-4o",
            Duration::from_secs(5),
        )
        .expect("client");
        let req = ChatRequest {
            messages: vec![Message::user("hi")],
            tools: vec![json!({"type": "function", "function": {"name": "bash"}})],
            max_tokens: None,
        };
        let r = p.complete(&req).await.expect("turn 0");
        assert_eq!(r.tool_calls[0].function.name, "bash");
        assert!(r.usage.is_some_and(|u| u.prompt_tokens > 0));
        let e = p.complete(&req).await.expect_err("turn 1 is a 429");
        assert!(
            matches!(e, LlmError::Retryable { retry_after: Some(d), .. } if d == Duration::from_secs(1)),
            "{e:?}"
        );
        let r = p.complete(&req).await.expect("turn 2");
        assert_eq!(r.tool_calls[0].function.name, "finish");
        // No tools: a summarization, not a turn.
        let s = p
            .complete(&ChatRequest {
                messages: vec![Message::user("step 1: a\nstep 2: b\n")],
                tools: vec![],
                max_tokens: None,
            })
            .await
            .expect("summary");
        assert!(s.content.contains("2 actions"), "{}", s.content);
        assert_eq!(server.turns(), 3);
        assert_eq!(server.summaries(), 1);
        assert_eq!(server.requests().len(), 4);
    }
}
