//! The model behind the agent: OpenAI-compatible Chat Completions with tool calling over HTTP.
//!
//! Parsing is tolerant by design: `arguments` may come as a JSON string (the spec) or as an
//! object (some servers), a legacy `function_call` is accepted, and a model that writes its tool
//! call as JSON in the message text instead of `tool_calls` is understood. What the arguments
//! mean is checked later, by [`super::tools`].

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Environment variable with the endpoint's base URL, e.g. `http://127.0.0.1:8000/v1`.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";
/// Environment variable with the API key sent as a bearer token.
pub const API_KEY_ENV: &str = "OPENAI_API_KEY";
/// Base URL when [`BASE_URL_ENV`] is unset.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// What a model call can fail with, sorted by what the loop should do about it.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// Worth trying again after a pause: timeouts, connection errors, 429 and 5xx.
    #[error("model endpoint temporarily failed: {message}")]
    Retryable {
        /// What happened.
        message: String,
        /// The server's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
    },
    /// The prompt is larger than the model accepts: compact and try again.
    #[error("the prompt exceeds the model's context window: {0}")]
    ContextTooLong(String),
    /// Authentication or authorization failed: no retry will help.
    #[error("model endpoint refused the credentials ({status}): {message}")]
    Auth {
        /// HTTP status (401 or 403).
        status: u16,
        /// The server's message.
        message: String,
    },
    /// Any other refusal (400, 404, …) or an answer that is not a chat completion.
    #[error("model endpoint error: {0}")]
    Fatal(String),
}

/// One chat message, in the wire shape of the Chat Completions API.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text; `None` for an assistant message that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The assistant's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A system message.
    pub fn system(text: impl Into<String>) -> Self {
        Self::text("system", text)
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::text("user", text)
    }

    /// The result of tool call `id`.
    pub fn tool(id: impl Into<String>, text: impl Into<String>) -> Self {
        Message {
            role: "tool".into(),
            content: Some(text.into()),
            tool_call_id: Some(id.into()),
            ..Default::default()
        }
    }

    /// An assistant message calling one tool.
    pub fn assistant_call(call: ToolCall, text: Option<String>) -> Self {
        Message {
            role: "assistant".into(),
            content: text.filter(|t| !t.is_empty()),
            tool_calls: vec![call],
            tool_call_id: None,
        }
    }

    fn text(role: &str, text: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Some(text.into()),
            ..Default::default()
        }
    }

    /// Everything in this message a tokenizer would see, for counting.
    pub fn countable_text(&self) -> String {
        let mut s = self.content.clone().unwrap_or_default();
        for call in &self.tool_calls {
            s.push_str(&call.function.name);
            s.push_str(&call.function.arguments);
        }
        s
    }
}

/// A tool call as the model sent it: `arguments` is the raw text, possibly malformed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, echoed in the tool message that answers it.
    #[serde(default)]
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function half of a tool call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// The arguments as JSON text.
    #[serde(default, deserialize_with = "string_or_json")]
    pub arguments: String,
}

/// Accepts `"arguments": "{...}"` (the spec) as well as `"arguments": {...}`.
fn string_or_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let v = Value::deserialize(d)?;
    Ok(match v {
        Value::String(s) => s,
        Value::Null => String::new(),
        other => other.to_string(),
    })
}

/// A tool offered to the model: name, description, JSON-schema parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: &'static str,
    /// What it does, for the model.
    pub description: &'static str,
    /// JSON schema of its arguments.
    pub parameters: Value,
}

impl ToolSpec {
    /// The `tools[]` entry of a request.
    pub fn to_wire(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// One model call.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Tools the model may call; empty for a plain completion (summaries).
    pub tools: Vec<Value>,
    /// Upper bound on the completion's tokens (the per-call budget).
    pub max_tokens: Option<u32>,
}

/// Token use as the endpoint reported it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
}

/// The model's answer.
#[derive(Clone, Debug, Default)]
pub struct ChatResponse {
    /// Text the model wrote (may be empty).
    pub content: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Token use, when the endpoint reported it.
    pub usage: Option<Usage>,
    /// `stop`, `tool_calls`, `length`, …
    pub finish_reason: String,
}

/// Something that answers chat requests.
#[async_trait]
pub trait LlmProvider: Send + Sync {
    /// The model's name.
    fn model(&self) -> &str;
    /// One completion.
    async fn complete(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError>;
}

/// An OpenAI-compatible Chat Completions endpoint.
#[derive(Clone, Debug)]
pub struct OpenAiProvider {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    model: String,
}

impl OpenAiProvider {
    /// A provider for `model` at `base_url` (the part before `/chat/completions`).
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        model: &str,
        timeout: Duration,
    ) -> Result<Self, LlmError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| LlmError::Fatal(format!("cannot build the HTTP client: {e}")))?;
        Ok(OpenAiProvider {
            http,
            url: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            api_key: api_key.filter(|k| !k.is_empty()),
            model: model.to_owned(),
        })
    }

    /// A provider configured from `OPENAI_BASE_URL` and `OPENAI_API_KEY`, as OpenAI's SDKs do.
    pub fn from_env(model: &str, timeout: Duration) -> Result<Self, LlmError> {
        let base = std::env::var(BASE_URL_ENV)
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_owned());
        Self::new(&base, std::env::var(API_KEY_ENV).ok(), model, timeout)
    }

    /// The request body for `request`.
    pub fn body(&self, request: &ChatRequest) -> Value {
        let mut body = json!({
            "model": self.model,
            "messages": request.messages,
        });
        if !request.tools.is_empty() {
            body["tools"] = Value::Array(request.tools.clone());
            body["tool_choice"] = json!("auto");
            // One action per step keeps every step atomic and checkpointable.
            body["parallel_tool_calls"] = json!(false);
        }
        if let Some(max) = request.max_tokens {
            body["max_tokens"] = json!(max);
        }
        body
    }
}

#[async_trait]
impl LlmProvider for OpenAiProvider {
    fn model(&self) -> &str {
        &self.model
    }

    async fn complete(&self, request: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let mut req = self.http.post(&self.url).json(&self.body(request));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(|e| LlmError::Retryable {
            message: format!("{}: {}", self.url, error_chain(&e)),
            retry_after: None,
        })?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Duration::from_secs_f64(s.min(300.0)));
        let text = resp.text().await.map_err(|e| LlmError::Retryable {
            message: format!("reading the answer: {}", error_chain(&e)),
            retry_after: None,
        })?;
        classify_http(status, &text, retry_after)?;
        parse_response(&text)
    }
}

/// `reqwest` hides the useful part (connection refused, timed out) in its sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// Maps an HTTP status to the error class the loop acts on.
pub(crate) fn classify_http(
    status: u16,
    body: &str,
    retry_after: Option<Duration>,
) -> Result<(), LlmError> {
    if (200..300).contains(&status) {
        return Ok(());
    }
    let message = error_message(body);
    match status {
        401 | 403 => Err(LlmError::Auth { status, message }),
        408 | 409 | 425 | 429 | 500..=599 => Err(LlmError::Retryable {
            message: format!("HTTP {status}: {message}"),
            retry_after,
        }),
        400 | 413 if looks_like_context_overflow(&message) => {
            Err(LlmError::ContextTooLong(message))
        }
        _ => Err(LlmError::Fatal(format!("HTTP {status}: {message}"))),
    }
}

fn looks_like_context_overflow(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("context_length")
        || m.contains("context length")
        || m.contains("too many tokens")
        || m.contains("maximum context")
}

/// The `error.message` of an OpenAI-style error body, else the body itself (bounded).
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("error"))
                .or_else(|| v.get("message"))
                .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned))
        })
        .unwrap_or_else(|| body.chars().take(500).collect())
}

/// Parses a Chat Completions answer, tolerating the variations servers and models produce.
pub fn parse_response(text: &str) -> Result<ChatResponse, LlmError> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        LlmError::Fatal(format!(
            "the answer is not JSON ({e}): {}",
            text.chars().take(200).collect::<String>()
        ))
    })?;
    let choice = v
        .pointer("/choices/0")
        .ok_or_else(|| LlmError::Fatal("the answer has no choices".into()))?;
    let message = choice.get("message").cloned().unwrap_or(Value::Null);
    let content = message
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut tool_calls: Vec<ToolCall> = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .filter_map(|(i, c)| {
                    let mut call: ToolCall = serde_json::from_value(c.clone()).ok()?;
                    if call.id.is_empty() {
                        call.id = format!("call_{i}");
                    }
                    Some(call)
                })
                .collect()
        })
        .unwrap_or_default();
    // The pre-tools API shape, still produced by some local servers.
    if tool_calls.is_empty() {
        if let Some(f) = message.get("function_call") {
            if let Ok(function) = serde_json::from_value::<FunctionCall>(f.clone()) {
                tool_calls.push(ToolCall {
                    id: "call_0".into(),
                    kind: function_type(),
                    function,
                });
            }
        }
    }
    if tool_calls.is_empty() {
        if let Some(call) = call_in_text(&content) {
            tool_calls.push(call);
        }
    }
    let usage = v
        .get("usage")
        .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok());
    Ok(ChatResponse {
        content,
        tool_calls,
        usage,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
    })
}

/// A tool call written as JSON in the text — `{"name": "bash", "arguments": {...}}`, possibly in
/// a ```json fence — which models without native tool calling tend to produce.
fn call_in_text(content: &str) -> Option<ToolCall> {
    let start = content.find('{')?;
    let end = content.rfind('}')?;
    let v: Value = serde_json::from_str(content.get(start..=end)?).ok()?;
    let name = v
        .get("name")
        .or_else(|| v.get("tool"))
        .and_then(Value::as_str)?;
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .or_else(|| v.get("args"))
        .cloned()
        .unwrap_or(json!({}));
    Some(ToolCall {
        id: "call_text".into(),
        kind: function_type(),
        function: FunctionCall {
            name: name.to_owned(),
            arguments: match args {
                Value::String(s) => s,
                other => other.to_string(),
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_standard_tool_call() {
        let text = r#"{"choices":[{"message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls\"}"}}]},
            "finish_reason":"tool_calls"}],"usage":{"prompt_tokens":10,"completion_tokens":3}}"#;
        let r = parse_response(text).expect("valid");
        assert_eq!(r.tool_calls.len(), 1);
        assert_eq!(r.tool_calls[0].function.name, "bash");
        assert_eq!(r.tool_calls[0].function.arguments, r#"{"command":"ls"}"#);
        assert_eq!(
            r.usage,
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 3
            })
        );
    }

    #[test]
    fn accepts_object_arguments_legacy_calls_and_calls_in_text() {
        let obj = r#"{"choices":[{"message":{"tool_calls":[{"function":{"name":"bash","arguments":{"command":"ls"}}}]}}]}"#;
        let r = parse_response(obj).expect("valid");
        assert_eq!(r.tool_calls[0].function.arguments, r#"{"command":"ls"}"#);
        assert_eq!(r.tool_calls[0].id, "call_0");

        let legacy = r#"{"choices":[{"message":{"function_call":{"name":"finish","arguments":"{\"answer\":\"4\"}"}}}]}"#;
        assert_eq!(
            parse_response(legacy).expect("valid").tool_calls[0]
                .function
                .name,
            "finish"
        );

        let text = "{\"choices\":[{\"message\":{\"content\":\"I will run it:\\n```json\\n{\\\"name\\\": \\\"bash\\\", \\\"arguments\\\": {\\\"command\\\": \\\"make\\\"}}\\n```\"}}]}";
        let r = parse_response(text).expect("valid");
        assert_eq!(r.tool_calls[0].function.name, "bash");
        assert!(r.tool_calls[0].function.arguments.contains("make"));
    }

    #[test]
    fn statuses_are_classified() {
        assert!(matches!(
            classify_http(429, "{}", None),
            Err(LlmError::Retryable { .. })
        ));
        assert!(matches!(
            classify_http(503, "busy", None),
            Err(LlmError::Retryable { .. })
        ));
        assert!(matches!(
            classify_http(401, r#"{"error":{"message":"bad key"}}"#, None),
            Err(LlmError::Auth { status: 401, ref message }) if message == "bad key"
        ));
        assert!(matches!(
            classify_http(
                400,
                r#"{"error":{"message":"This model's maximum context length is 8192 tokens"}}"#,
                None
            ),
            Err(LlmError::ContextTooLong(_))
        ));
        assert!(matches!(
            classify_http(404, "nope", None),
            Err(LlmError::Fatal(_))
        ));
        assert!(classify_http(200, "", None).is_ok());
    }

    #[test]
    fn body_offers_tools_one_at_a_time() {
        let p = OpenAiProvider::new("http://x/v1/", None, "m", Duration::from_secs(1))
            .expect("client builds");
        assert_eq!(p.url, "http://x/v1/chat/completions");
        let body = p.body(&ChatRequest {
            messages: vec![Message::user("hi")],
            tools: vec![json!({"type":"function"})],
            max_tokens: Some(100),
        });
        assert_eq!(body["parallel_tool_calls"], json!(false));
        assert_eq!(body["max_tokens"], json!(100));
        assert_eq!(body["messages"][0]["role"], json!("user"));
        assert!(body["messages"][0].get("tool_calls").is_none());
    }
}
