//! Messages between coordinators and workers, encoded with rkyv.
//!
//! Every message is a [`Wire`]: an [`Envelope`] (publisher, sequence number, protocol
//! version) and a [`Body`]. Bytes from the network are decoded with validation
//! ([`decode`]): NATS payloads carry no alignment guarantee, so they are first copied
//! into an aligned buffer, then checked by rkyv's bytecheck before any field is read.

use rkyv::{rancor, util::AlignedVec, Archive, Deserialize, Serialize};

use crate::ids::{CoordinatorId, StreamId, WorkerId};

/// Version of this protocol; receivers drop messages of another major version.
pub const PROTOCOL_VERSION: u16 = 8;

/// Largest message a receiver accepts (bytes), whatever NATS allows.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Who sent a message and in what order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    /// Process id of the publisher (a worker's or coordinator's id bits).
    pub publisher: u128,
    /// Per-publisher, per-subject counter from 0: receivers see gaps and duplicates.
    pub seq: u64,
    /// [`PROTOCOL_VERSION`] of the publisher.
    pub version: u16,
}

/// A message as it travels.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Wire {
    /// Who and when.
    pub envelope: Envelope,
    /// What.
    pub body: Body,
}

/// Every message kind.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Body {
    /// A worker's periodic announcement.
    Heartbeat(Heartbeat),
    /// New sequences for a worker.
    Submit(Submit),
    /// A worker's answer to a [`Submit`].
    SubmitReply(SubmitReply),
    /// Sequences a worker must stop.
    Cancel(Cancel),
    /// One decode step's events for one coordinator.
    Tokens(TokenBatch),
    /// Are you there, and do you still run these streams? (request/reply on a
    /// worker's submit subject).
    Probe(Probe),
    /// A worker's answer to a [`Body::Probe`].
    ProbeReply(ProbeReply),
    /// Stop taking work, finish what runs, then leave (request/reply on a worker's
    /// submit subject; an operator's drain, forwarded by a coordinator).
    Drain(DrainWorker),
    /// A worker's answer to a [`Body::Drain`].
    DrainReply(DrainReply),
    /// Token ids of text or chat messages, or the text of token ids, with a model's
    /// tokenizer (request/reply on a worker's submit subject; nothing runs through the
    /// model).
    Tokenize(TokenizeRequest),
    /// A worker's answer to a [`Body::Tokenize`].
    TokenizeReply(TokenizeReply),
    /// Load a model file beside what runs, then serve it (request/reply on a worker's
    /// submit subject; an operator's order, forwarded by a coordinator).
    LoadModel(LoadModel),
    /// Stop serving a model: new requests no longer reach it, streams on it finish.
    UnloadModel(UnloadModel),
    /// A worker's answer to a [`Body::LoadModel`] or [`Body::UnloadModel`].
    ModelReply(ModelReply),
}

/// An order to load a model file.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LoadModel {
    /// The GGUF file, as the worker's host sees it.
    pub path: String,
    /// Its SHA-256 (hex); `None`: the one in `<path>.sha256` beside it.
    pub sha256: Option<String>,
    /// The public name to serve it as; `None`: the name of the model it replaces (the
    /// file's stem when it is added).
    pub name: Option<String>,
    /// Serve it beside the models served now; without it, it takes the place of the
    /// served model of its name, or of the only model served.
    pub add: bool,
}

/// An order to stop serving a model.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct UnloadModel {
    /// Its public name.
    pub name: String,
}

/// What a worker did with a [`LoadModel`] or [`UnloadModel`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ModelReply {
    /// The worker.
    pub worker: WorkerId,
    /// Why nothing changed; `None`: done.
    pub error: Option<WireError>,
    /// The model loaded (a load that succeeded).
    pub loaded: Option<ModelInfo>,
    /// The models served now.
    pub serving: Vec<ModelInfo>,
    /// Streams still running on models no longer served, which finish there.
    pub retiring_streams: u32,
}

/// What to tokenize or detokenize.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenizeRequest {
    /// The model whose tokenizer to use.
    pub model: String,
    /// The input.
    pub input: TokenizeInput,
}

/// The input of a [`TokenizeRequest`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum TokenizeInput {
    /// Text.
    Text(TextInput),
    /// Chat messages rendered with the model's template, as a chat request's prompt
    /// is.
    Chat(ChatInput),
    /// Token ids to turn back into text (special tokens included).
    Ids(Vec<u32>),
}

/// Text to tokenize.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TextInput {
    /// The text.
    pub text: String,
    /// Add the tokenizer's own special tokens (a leading BOS where the model wants one).
    pub add_special: bool,
}

/// Chat messages to tokenize.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ChatInput {
    /// The messages.
    pub turns: Vec<ChatTurn>,
    /// End with what opens the assistant's turn.
    pub add_generation_prompt: bool,
    /// Tools offered to the model (OpenAI's array as JSON text, checked), rendered as a
    /// chat request offering them renders them.
    pub tools: Option<String>,
}

/// A worker's answer to a [`TokenizeRequest`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum TokenizeReply {
    /// The ids of text or chat messages.
    Tokens(TokenIds),
    /// The text of ids.
    Text(String),
    /// The input cannot be (de)tokenized (an unknown model, an id past the vocabulary,
    /// a template that refuses the messages).
    Failed(WireError),
}

/// Token ids, and the context they must fit.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenIds {
    /// The ids.
    pub ids: Vec<u32>,
    /// The model's context length.
    pub context_length: u32,
}

/// An order to drain.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DrainWorker {
    /// Why, for the worker's log.
    pub reason: String,
    /// How long the worker lets its running streams finish before it hands the rest
    /// over (fails them with [`ErrorKind::Draining`], which the coordinator answers by
    /// resuming them elsewhere), in milliseconds; `None`: the worker's own setting.
    pub handover_after_ms: Option<u64>,
}

/// A worker took a drain order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DrainReply {
    /// The worker.
    pub worker: WorkerId,
    /// Sequences still running, which it finishes before it leaves.
    pub running: u32,
    /// Sequences accepted but not yet running.
    pub queued: u32,
}

/// A coordinator's liveness probe.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Probe {
    /// The streams the coordinator believes run on the worker.
    pub streams: Vec<StreamAttempt>,
}

/// A worker's answer to a probe: it is alive, and this is what it holds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ProbeReply {
    /// The worker.
    pub worker: WorkerId,
    /// Sequences running now.
    pub running: u32,
    /// Sequences accepted but not yet running.
    pub queued: u32,
    /// Those of the probe's streams this worker does not hold (finished, lost, never
    /// arrived): their coordinator resumes them.
    pub missing: Vec<StreamAttempt>,
}

/// A worker's state, published every heartbeat interval.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Heartbeat {
    /// The worker.
    pub worker: WorkerId,
    /// Models it serves.
    pub models: Vec<ModelInfo>,
    /// Most sequences it runs at once.
    pub capacity: u32,
    /// Sequences running now.
    pub running: u32,
    /// Sequences accepted but not yet running.
    pub queued: u32,
    /// KV cache bytes in use.
    pub kv_used_bytes: u64,
    /// KV cache budget in bytes.
    pub kv_budget_bytes: u64,
    /// Taking no new work.
    pub draining: bool,
    /// The worker's software version.
    pub version: String,
}

/// A model a worker serves.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name clients ask for.
    pub name: String,
    /// Longest sequence (prompt and output) in tokens.
    pub context_length: u32,
    /// Hash of weights, tokenizer and the arithmetic they run with (weight format, KV
    /// cache type): equal fingerprints, equal model, computed the same way.
    pub fingerprint: u64,
}

/// New sequences for one worker.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Submit {
    /// Where the tokens go ([`crate::subjects::Subjects::tokens`]).
    pub coordinator: CoordinatorId,
    /// The sequences (one message carries a batch).
    pub sequences: Vec<SeqRequest>,
}

/// One sequence to run.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// Its stream.
    pub stream: StreamId,
    /// Model name.
    pub model: String,
    /// What to continue.
    pub prompt: PromptSpec,
    /// How to generate.
    pub params: GenParams,
    /// Which dispatch of the stream this is: 0 first, one more at each resume. The
    /// worker echoes it in every event, so that events of an abandoned attempt are told
    /// apart from the live one.
    pub attempt: u32,
    /// Continue a stream from a checkpoint instead of starting it.
    pub resume: Option<Resume>,
    /// Most prompt tokens the coordinator accepts (0: no limit but the model's
    /// context). The worker counts the prompt after tokenizing and refuses a longer
    /// one with [`ErrorKind::PromptTooLong`] before any compute.
    pub max_prompt_tokens: u32,
}

/// Where a resumed stream continues from.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Resume {
    /// Every token generated so far, in order (positions 0..n).
    pub tokens: Vec<u32>,
    /// The chain hash after the last of them ([`crate::chain`]); the worker refuses with
    /// [`ErrorKind::ChainMismatch`] when its own chain over the prompt and `tokens`
    /// ends elsewhere.
    pub hash: u64,
}

/// A prompt as the client gave it; the worker tokenizes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum PromptSpec {
    /// Raw text.
    Text(String),
    /// Chat messages, rendered with the model's template.
    Chat(Vec<ChatTurn>),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// One chat message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Text (empty for an assistant turn that only calls tools).
    pub content: String,
    /// The tools an assistant turn called (OpenAI's `tool_calls`); empty otherwise.
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` turn answers (OpenAI's `tool_call_id`).
    pub tool_call_id: Option<String>,
}

impl ChatTurn {
    /// A turn of `role` saying `content`, with no tool calls.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// One call of a function, in a chat's history or in a model's output.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// Its place among the output's calls (0 for the first); in a history, its place in
    /// the turn's list.
    pub index: u32,
    /// `call_…`, unique within the stream ([`tool_call_id`]); a history's as the client
    /// sent it.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text (an object).
    pub arguments: String,
}

/// The id of a stream's `index`-th tool call: the same on every worker that runs the
/// stream, so that a resumed stream names its calls as the first attempt did.
pub fn tool_call_id(stream: crate::ids::StreamId, index: u32) -> String {
    // The stream id's simple form: 32 hex digits.
    format!("call_{}{index:04x}", &stream.to_string()[..20])
}

/// The functions a chat may call, and whether it must.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    /// OpenAI's `tools` array as JSON text (`[{"type": "function", "function": {"name",
    /// "description", "parameters"}}]`), checked by the coordinator: each function has a
    /// name and a `parameters` JSON schema that compiles.
    pub definitions: String,
    /// Whether the model must call one (`tool_choice`).
    pub choice: ToolChoice,
    /// Whether it may call several in one turn (`parallel_tool_calls`).
    pub parallel: bool,
}

/// OpenAI's `tool_choice` (`none` travels as no [`Tools`] at all).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides; its output is parsed for calls.
    Auto,
    /// The model calls at least one of the functions (a grammar holds it to that).
    Required,
    /// The model calls this function (a grammar holds it to that).
    Function(String),
}

/// Generation parameters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct GenParams {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Temperature; 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0: off).
    pub top_k: u32,
    /// Repetition penalty (1: off).
    pub repetition_penalty: f32,
    /// Sampler seed.
    pub seed: u64,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// A grammar the output must follow (structured output); `None`: free text.
    pub grammar: Option<Grammar>,
    /// Subtracted from the logit of every token the output already holds (OpenAI's
    /// `presence_penalty`, −2..=2; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it (OpenAI's
    /// `frequency_penalty`, −2..=2; 0: off).
    pub frequency_penalty: f32,
    /// Drop the tokens whose probability is below `min_p` × the largest one (0: off).
    pub min_p: f32,
    /// Added to the logits of these tokens before every draw (−100..=100).
    pub logit_bias: Vec<LogitBias>,
    /// No end token, stop token or stop string ends the output before it holds this
    /// many tokens.
    pub min_tokens: u32,
    /// Tokens that end the output when drawn, like end-of-sequence (not in its text).
    pub stop_token_ids: Vec<u32>,
    /// Report each drawn token's log-probability and this many of the most likely
    /// tokens' (0..=20) with it; `None`: none.
    pub logprobs: Option<u8>,
    /// Score the prompt (a completion's `echo`): each prompt token's log-probability
    /// given the tokens before it, with this many of the most likely tokens' (0..=20),
    /// sent once the prompt has run ([`EventKind::Prompt`]); `None`: not asked. With it
    /// `max_tokens` may be 0: the prompt is scored and nothing generated.
    pub prompt_logprobs: Option<u8>,
    /// Functions the model may call (chat only); `None`: no tools.
    pub tools: Option<Tools>,
    /// Chat messages may spell the model's special tokens (`<|im_start|>`) and have them
    /// read as such: only for clients trusted to write turns of their own. Otherwise such
    /// text in a message is read as plain text.
    pub content_specials: bool,
}

/// A bias added to one token's logit.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct LogitBias {
    /// The token.
    pub id: u32,
    /// What is added to its logit.
    pub bias: f32,
}

impl GenParams {
    /// Plain parameters: `max_tokens` tokens, greedy, nothing else asked for.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
            seed: 0,
            stop: Vec::new(),
            ignore_eos: false,
            grammar: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            tools: None,
            content_specials: false,
        }
    }
}

/// A grammar an output must follow, as the client gave it: the worker compiles it
/// against its tokenizer ([`crate::grammar`]) and masks every draw with it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// A JSON schema, as JSON text (`{"type": "object"}` for any JSON object).
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// A worker's answer to a submit, per sequence.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SubmitReply {
    /// One outcome per submitted sequence, in order.
    pub outcomes: Vec<SubmitOutcome>,
}

/// Whether one sequence was taken.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum SubmitOutcome {
    /// Running or queued; events will follow.
    Accepted(Accepted),
    /// Refused; nothing will follow.
    Refused(Refused),
}

/// A sequence a worker took.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The stream.
    pub stream: StreamId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
}

/// A sequence a worker refused.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Refused {
    /// The stream.
    pub stream: StreamId,
    /// Why.
    pub error: WireError,
}

/// Sequences to stop.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Cancel {
    /// The streams, each with the latest attempt to stop: a newer attempt of the same
    /// stream (a resume sent after the cancel) keeps running.
    pub streams: Vec<StreamAttempt>,
}

/// One attempt of one stream.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamAttempt {
    /// The stream.
    pub stream: StreamId,
    /// The attempt ([`SeqRequest::attempt`]).
    pub attempt: u32,
}

/// Events of one decode step, for one coordinator.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenBatch {
    /// The publishing worker.
    pub worker: WorkerId,
    /// One event per stream that moved.
    pub events: Vec<StreamEvent>,
}

/// What happened to one stream.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StreamEvent {
    /// The stream.
    pub stream: StreamId,
    /// The attempt of [`SeqRequest::attempt`] this event belongs to.
    pub attempt: u32,
    /// The event.
    pub kind: EventKind,
}

/// Stream event kinds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum EventKind {
    /// The scored prompt ([`GenParams::prompt_logprobs`]), before the first token.
    Prompt(PromptEcho),
    /// A step ran part of the sequence's prompt (chunked prefill) and gave no token: the
    /// positions its KV cache now holds. A long prompt is alive, not stalled.
    Progress(u32),
    /// A generated token.
    Token(TokenEvent),
    /// The stream ended normally (after its last token event).
    Finished(Finished),
    /// The stream failed on the worker.
    Failed(WireError),
}

/// A prompt as the model read it, with each token's log-probability.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PromptEcho {
    /// The prompt's text (special tokens left out).
    pub text: String,
    /// The first prompt token's bytes (it has no log-probability: nothing precedes it).
    pub first: Vec<u8>,
    /// Every later prompt token's log-probability given the tokens before it, from the
    /// model's logits as they are (no penalty or mask applies to a prompt), with
    /// `text_offset` counted in [`PromptEcho::text`].
    pub logprobs: Vec<TokenLogprobs>,
}

/// A generated token.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// Index in the output (0 = first generated token).
    pub index: u32,
    /// Token id.
    pub id: u32,
    /// The chain hash after this token ([`crate::chain`]).
    pub hash: u64,
    /// Text that became final with it (may be empty).
    pub text: String,
    /// Its log-probability and the most likely alternatives, when the request asked
    /// ([`GenParams::logprobs`]).
    pub logprobs: Option<TokenLogprobs>,
    /// Pieces of tool calls this token wrote ([`GenParams::tools`]): a call's first
    /// piece has its name (and, named by the coordinator, its id), later ones only more
    /// of its `arguments` ([`crate::tools::merge`] joins them). Their text is not in
    /// `text`.
    pub tool_calls: Vec<ToolCall>,
}

/// A drawn token's log-probability and the most likely tokens' at its position, from
/// the distribution the sampler drew from after the grammar's mask, `logit_bias`,
/// `min_tokens` and the penalties, before temperature and truncation (`top_k`, `top_p`,
/// `min_p`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The drawn token's natural log-probability.
    pub logprob: f32,
    /// The drawn token's bytes (a token may hold part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Characters of the output's text before the text this token made final (the
    /// legacy completions format's `text_offset`).
    pub text_offset: u32,
    /// The most likely tokens, most likely first (equal values by id).
    pub top: Vec<TopLogprob>,
}

/// One of the most likely tokens at a position.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TopLogprob {
    /// Token id.
    pub id: u32,
    /// Natural log-probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// How a stream ended.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Finished {
    /// Why.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens whose keys and values came from the worker's prefix cache instead of
    /// running through the model (on the attempt that finished).
    pub cached_tokens: u32,
}

/// Why a stream ended.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token or stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled by the coordinator.
    Cancelled,
    /// The output ended (as with `Stop`) after calling tools.
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::Cancelled => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// An error that travels: a stable kind and a message for people.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// Stable kind.
    pub kind: ErrorKind,
    /// Human-readable detail.
    pub message: String,
}

/// Stable error kinds (no HTTP here: the coordinator maps them to status codes).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or out of range.
    InvalidRequest,
    /// The prompt does not fit the model's context.
    PromptTooLong,
    /// No such model here.
    UnknownModel,
    /// The worker is full.
    Overloaded,
    /// The worker is draining.
    Draining,
    /// Something broke inside the worker.
    Internal,
    /// A resume whose chain hash this worker cannot reproduce (another model).
    ChainMismatch,
}

impl ErrorKind {
    /// A stable snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::PromptTooLong => "prompt_too_long",
            ErrorKind::UnknownModel => "unknown_model",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Draining => "draining",
            ErrorKind::Internal => "internal",
            ErrorKind::ChainMismatch => "chain_mismatch",
        }
    }
}

/// Why bytes were not a message.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Over [`MAX_MESSAGE_BYTES`].
    #[error("message of {0} bytes is over the limit")]
    TooLarge(usize),
    /// Not a valid archive of [`Wire`].
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Another protocol version.
    #[error("protocol version {0} is not {PROTOCOL_VERSION}")]
    Version(u16),
}

impl DecodeError {
    /// A stable identifier for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::TooLarge(_) => "too_large",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::Version(_) => "version",
        }
    }
}

/// Encodes a message.
pub fn encode(wire: &Wire) -> Vec<u8> {
    rkyv::to_bytes::<rancor::Error>(wire)
        .expect("serializing owned values into a growable buffer cannot fail")
        .into_vec()
}

/// Bytes a submit carrying `req` takes on the wire when the stream is resumed with
/// `room` generated tokens (its largest form: every later dispatch is at most this big),
/// envelope included.
pub fn submit_bytes(req: &SeqRequest, room: u32) -> usize {
    let mut req = req.clone();
    req.resume = Some(Resume {
        tokens: vec![0; room as usize],
        hash: 0,
    });
    encode(&Wire {
        envelope: Envelope {
            publisher: 0,
            seq: 0,
            version: PROTOCOL_VERSION,
        },
        body: Body::Submit(Submit {
            coordinator: CoordinatorId(0),
            sequences: vec![req],
        }),
    })
    .len()
}

/// Decodes and validates bytes from the network. Never panics on any input.
pub fn decode(bytes: &[u8]) -> Result<Wire, DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError::TooLarge(bytes.len()));
    }
    // NATS payloads have no alignment guarantee; rkyv's checked access needs one.
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    let wire = rkyv::from_bytes::<Wire, rancor::Error>(&aligned)
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if wire.envelope.version != PROTOCOL_VERSION {
        return Err(DecodeError::Version(wire.envelope.version));
    }
    Ok(wire)
}

/// Numbers the messages one publisher sends.
#[derive(Debug)]
pub struct Sequencer {
    publisher: u128,
    next: std::sync::atomic::AtomicU64,
}

impl Sequencer {
    /// Starts at 0 for `publisher`.
    pub fn new(publisher: u128) -> Self {
        Self {
            publisher,
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Wraps a body in the next envelope and encodes it.
    pub fn encode(&self, body: Body) -> Vec<u8> {
        let seq = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        encode(&Wire {
            envelope: Envelope {
                publisher: self.publisher,
                seq,
                version: PROTOCOL_VERSION,
            },
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Wire {
        Wire {
            envelope: Envelope {
                publisher: 7,
                seq: 3,
                version: PROTOCOL_VERSION,
            },
            body: Body::Tokens(TokenBatch {
                worker: WorkerId(9),
                events: vec![
                    StreamEvent {
                        stream: StreamId(1),
                        attempt: 0,
                        kind: EventKind::Token(TokenEvent {
                            index: 0,
                            id: 42,
                            hash: 0xfeed,
                            text: "héllo".into(),
                            logprobs: Some(TokenLogprobs {
                                logprob: -0.5,
                                bytes: b"h\xc3".to_vec(),
                                text_offset: 3,
                                top: vec![TopLogprob {
                                    id: 3,
                                    logprob: -1.25,
                                    bytes: b"x".to_vec(),
                                }],
                            }),
                            tool_calls: vec![ToolCall {
                                index: 0,
                                id: "call_1".into(),
                                name: "f".into(),
                                arguments: "{}".into(),
                            }],
                        }),
                    },
                    StreamEvent {
                        stream: StreamId(2),
                        attempt: 3,
                        kind: EventKind::Failed(WireError {
                            kind: ErrorKind::Internal,
                            message: "boom".into(),
                        }),
                    },
                ],
            }),
        }
    }

    #[test]
    fn round_trip() {
        let w = sample();
        assert_eq!(decode(&encode(&w)).expect("decode"), w);
    }

    #[test]
    fn unaligned_payloads_decode() {
        // A payload at an odd address, as a NATS buffer may hand it over.
        let bytes = encode(&sample());
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        assert_eq!(decode(&shifted[1..]).expect("decode"), sample());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode(b"").is_err());
        assert!(decode(b"hello world, not rkyv").is_err());
        let bytes = encode(&sample());
        let mut state = 0x1234_5678u32;
        for _ in 0..2000 {
            let mut b = bytes.clone();
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let i = (state as usize) % b.len();
            b[i] ^= (state >> 16) as u8 | 1;
            let _ = decode(&b);
            let _ = decode(&b[..i]);
        }
    }

    #[test]
    fn other_versions_are_refused() {
        let mut w = sample();
        w.envelope.version = PROTOCOL_VERSION + 1;
        assert!(matches!(decode(&encode(&w)), Err(DecodeError::Version(_))));
    }

    #[test]
    fn sequencer_counts() {
        let s = Sequencer::new(5);
        let a = decode(&s.encode(Body::Cancel(Cancel { streams: vec![] }))).expect("a");
        let b = decode(&s.encode(Body::Cancel(Cancel { streams: vec![] }))).expect("b");
        assert_eq!((a.envelope.seq, b.envelope.seq), (0, 1));
        assert_eq!(a.envelope.publisher, 5);
    }
}
