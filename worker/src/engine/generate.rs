//! Turning prompts into completions: sequences, stop conditions and the decode loop.
//!
//! A [`Sequence`] carries everything one request needs between steps (its cache, its
//! sampler, its stop state). [`Engine::step`] advances any number of sequences by one
//! token with one batched forward pass, so a scheduler can add and remove sequences
//! between steps (continuous batching); [`Engine::generate`] is the one-sequence loop.
//!
//! With a prefix cache ([`Engine::set_prefix_cache`]), a sequence's first step starts
//! from the cached keys and values of its longest cached prefix and runs only the rest
//! of its prompt; after each step that runs part of a prompt its full blocks are
//! stored, and those of prompt and output once it finishes. With a step budget
//! ([`Engine::set_step_tokens`]) a long prompt runs in chunks over several steps.

use std::{
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, OnceLock, PoisonError,
    },
};

use baton_common::{
    chain::{block_hashes, root},
    protocol::Grammar,
};

use baton_common::protocol::{ToolCall, ToolChoice};
use baton_common::tools::{Function, ToolFormat, ToolParser};
use burn_tensor::backend::Backend;

use super::{
    chat::{message_spans, ChatError, ChatMessage, ChatTemplate},
    gguf::{GgufError, GgufFile},
    guide::{apply_mask, Guide, Guides},
    llama::{
        load::load_planned, model::ForwardError, preflight::preflight, Fetch, KvCache, KvDtype,
        Llama, LoadError, SeqInput, WeightDtype,
    },
    prefix::{PrefixCache, PrefixStats, BLOCK_TOKENS},
    sampler::{SamplingError, SamplingParams},
    stops::StopMatcher,
    tokenizer::{StreamDecoder, Tokenizer, TokenizerError},
};

mod sequence;
mod step;

pub use sequence::Sequence;

/// Why the engine refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The model could not be built from the file.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Tokenizing or detokenizing failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The chat template failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The model file has no chat template but a chat request came.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// A message spells special tokens and the chat template does not copy it whole, so
    /// its text cannot be kept apart from the template's own tokens.
    #[error(
        "message {0} spells special tokens of the model, and the chat template changes its \
         text: it cannot be read as plain text"
    )]
    UnguardedContent(usize),
    /// A field the template writes besides a message's text spells special tokens.
    #[error("{0} spells special tokens of the model; only a message's text may hold them")]
    SpecialText(String),
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The prompt is empty after tokenization.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the context.
    #[error("the prompt has {prompt} tokens but the context holds {context}")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Context length.
        context: usize,
    },
    /// `max_tokens` was 0 for a prompt not scored.
    #[error("max_tokens must be at least 1 (0 only when the prompt is scored)")]
    ZeroMaxTokens,
    /// The forward pass refused its input.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// A resume's tokens go on after the sequence would have ended.
    #[error("resumed token {index} of {tokens} comes after the sequence's end")]
    ResumePastEnd {
        /// Index of the first token past the end.
        index: usize,
        /// Tokens in the resume.
        tokens: usize,
    },
    /// The request's grammar cannot be used with this model.
    #[error("the grammar cannot be used: {0}")]
    Grammar(String),
    /// A resumed token that the request's grammar does not allow where it stands: the
    /// stream was not made under this grammar as this worker runs it.
    #[error("resumed token {index} is not allowed by the grammar: {message}")]
    ResumeOffGrammar {
        /// Index of the token.
        index: usize,
        /// What the grammar engine said.
        message: String,
    },
    /// A token id a request names (`logit_bias`, `stop_token_ids`) is not in the
    /// vocabulary.
    #[error("{field} names token {id}, but the vocabulary has {vocab} tokens")]
    TokenOutOfVocab {
        /// The request's field.
        field: &'static str,
        /// The token.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// More alternatives asked for per token than [`MAX_TOP_LOGPROBS`].
    #[error("at most {MAX_TOP_LOGPROBS} top logprobs per token, got {0}")]
    TooManyLogprobs(usize),
    /// The device failed while the weights were put on it or the first kernels were
    /// compiled (a missing adapter, a broken driver or toolkit).
    #[error("the device {device} failed at load: {message}")]
    Device {
        /// The device, as the backend names it.
        device: String,
        /// What the backend said.
        message: String,
    },
}

impl EngineError {
    /// A stable identifier for error bodies and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Gguf(e) => e.kind(),
            EngineError::Load(e) => e.kind(),
            EngineError::Tokenizer(e) => e.kind(),
            EngineError::Chat(e) => e.kind(),
            EngineError::NoChatTemplate => "no_chat_template",
            EngineError::UnguardedContent(_) => "unguarded_content",
            EngineError::SpecialText(_) => "special_text",
            EngineError::Sampling(_) => "invalid_sampling",
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::PromptTooLong { .. } => "prompt_too_long",
            EngineError::ZeroMaxTokens => "invalid_max_tokens",
            EngineError::Forward(_) => "forward",
            EngineError::ResumePastEnd { .. } => "resume_past_end",
            EngineError::Grammar(_) => "invalid_grammar",
            EngineError::ResumeOffGrammar { .. } => "resume_off_grammar",
            EngineError::TokenOutOfVocab { .. } => "token_out_of_vocab",
            EngineError::TooManyLogprobs(_) => "too_many_logprobs",
            EngineError::Device { .. } => "device",
        }
    }
}

/// Most alternatives a token's logprobs list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What a request asks for, besides its prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How tokens are picked.
    pub sampling: SamplingParams,
    /// Strings that end the completion (not included in it).
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (not past a grammar's end).
    pub ignore_eos: bool,
    /// A grammar every token must follow (structured output).
    pub grammar: Option<Grammar>,
    /// No end token, stop token or stop string ends the output before it holds this many
    /// tokens: until then end and stop tokens are never drawn, and stop strings are not
    /// looked for.
    pub min_tokens: usize,
    /// Tokens that end the output when drawn, as end-of-sequence does (even with
    /// `ignore_eos`); not part of its text.
    pub stop_token_ids: Vec<u32>,
    /// Report each token's log-probability with this many of the most likely tokens'.
    pub logprobs: Option<usize>,
    /// Score the prompt: each prompt token's log-probability given the tokens before
    /// it, with this many of the most likely tokens' ([`Sequence::take_prompt_scores`]).
    /// Such a prompt runs one token a step (every position's logits are needed, and the
    /// prefix cache is not used for it); `max_tokens` may then be 0.
    pub prompt_logprobs: Option<usize>,
    /// Functions the model may call: its output is parsed for calls (and held to one
    /// by a grammar when the choice requires it).
    pub tools: Option<ToolUse>,
}

/// The functions a sequence may call and whether it must.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    /// The functions, checked.
    pub functions: Vec<Function>,
    /// `auto`, `required` or one function.
    pub choice: ToolChoice,
    /// Several calls allowed in one answer.
    pub parallel: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            grammar: None,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            tools: None,
        }
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Eos,
    /// A stop string appeared.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The grammar allowed no token (see [`Sequence::failure`]): an error, not an end.
    GrammarFailed,
}

impl FinishReason {
    /// The OpenAI `finish_reason` for it.
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::StopString => "stop",
            FinishReason::MaxTokens | FinishReason::ContextFull => "length",
            FinishReason::GrammarFailed => "error",
        }
    }
}

/// One generated token, as a stream sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// Index of the token in the output (0 for the first generated token).
    pub index: usize,
    /// Token id.
    pub id: u32,
    /// Text that became final with this token (may be empty: an incomplete UTF-8
    /// character, or text held back while it may start a stop string).
    pub text: String,
    /// Its log-probability, when the request asked ([`GenerateParams::logprobs`]).
    pub logprobs: Option<Logprobs>,
    /// Pieces of tool calls this token wrote ([`GenerateParams::tools`]): a call's
    /// first piece has its name, later ones more of its arguments. Their text is not in
    /// `text`.
    pub tool_calls: Vec<ToolCall>,
}

/// A drawn token's log-probability and the most likely tokens' at its position, under
/// the distribution it was drawn from after the grammar's mask, `min_tokens`,
/// `logit_bias` and the penalties, before temperature and truncation.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The drawn token's natural log-probability.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
    /// Characters of the output's text before the text this token made final.
    pub text_offset: usize,
}

/// A finished completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Generated token ids (including a final end-of-sequence token, if any).
    pub ids: Vec<u32>,
    /// Generated text, cut before a stop string and without end-of-sequence tokens (and
    /// without the text of tool calls).
    pub text: String,
    /// Tool calls found in the output ([`GenerateParams::tools`]).
    pub tool_calls: Vec<ToolCall>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The scored prompt's entries ([`GenerateParams::prompt_logprobs`]; empty when not
    /// asked).
    pub prompt_logprobs: Vec<Logprobs>,
}

/// A prompt, as text or as chat messages.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized as is.
    Text(String),
    /// Messages rendered through the model's chat template.
    Chat(Vec<ChatMessage>),
}

/// A model, its tokenizer and chat template: everything needed to serve completions.
pub struct Engine<B: Backend> {
    model: Llama<B>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    /// Tokens that end a completion: the model's EOS and the end-of-turn tokens its
    /// vocabulary defines.
    end_tokens: Vec<u32>,
    /// Hash of the weight file and tokenizer.
    weights_fingerprint: u64,
    /// How the weights are kept in memory.
    weights: WeightDtype,
    /// [`Engine::fingerprint`].
    fingerprint: u64,
    /// Keys and values of prompt blocks kept across sequences (disabled until
    /// [`Engine::set_prefix_cache`] gives it a budget). Behind a lock because
    /// [`Engine::step`] takes `&self`; only the thread that steps uses it.
    prefix: Mutex<PrefixCache>,
    /// Most tokens one step runs (0: no limit); see [`Engine::set_step_tokens`].
    step_tokens: AtomicUsize,
    /// Rows of logits the device engine has downloaded ([`Engine::downloaded_rows`]).
    downloaded_rows: AtomicUsize,
    /// The vocabulary as the grammar engine sees it, made at the first grammar.
    guides: OnceLock<Result<Guides, String>>,
}

/// [`Engine::fingerprint`] from the hash of the weight file and tokenizer.
fn numerics_fingerprint<B: Backend>(weights: u64, dtype: WeightDtype, model: &Llama<B>) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&weights.to_le_bytes());
    hasher.update(format!("weights={dtype} kv={}", model.kv_dtype()).as_bytes());
    // A grammar's masks are part of what a draw depends on.
    hasher.update(baton_common::grammar::ENGINE.as_bytes());
    hasher.update(format!(" held={}", model.held_formats()).as_bytes());
    if !model.host_path() {
        // The device engine's arithmetic is its backend's kernels, chosen for the
        // device's hardware (the device's index left out: two alike devices compute
        // alike).
        let device: String = format!("{:?}", model.device())
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .collect();
        hasher.update(
            format!(
                " engine=device backend={} device={device} hardware={}",
                B::name(model.device()),
                crate::backend::device_identity::<B>(model.device())
            )
            .as_bytes(),
        );
    }
    hasher.digest()
}

impl<B: Backend> Engine<B> {
    /// Loads a GGUF model file onto `device`.
    pub fn load(path: &Path, dtype: WeightDtype, device: &B::Device) -> Result<Self, EngineError> {
        let gguf = GgufFile::open(path)?;
        let mut last_decile = 0;
        let mut progress = |done: usize, total: usize| {
            let decile = done * 10 / total.max(1);
            if decile > last_decile {
                last_decile = decile;
                tracing::info!(
                    percent = decile * 10,
                    tensors = done,
                    total,
                    "loading model"
                );
            }
        };
        // Everything the file asks for is checked before any weight is read: the forward
        // pass's needs, then the tokenizer and the chat template.
        let plan = preflight(&gguf)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let chat = ChatTemplate::from_gguf(&gguf)?;
        let model = if dtype.is_native() {
            load_planned::<B>(&gguf, &plan, dtype, device, &mut progress)?
        } else {
            // The device engine: burn panics when the device cannot run (no adapter, a
            // driver or toolkit that fails a kernel's compile), so the upload and one
            // token through the network (which compiles the forward pass's kernels now,
            // not at the first request) are run where such a panic becomes the error.
            let run = || -> Result<Llama<B>, EngineError> {
                let mut model = load_planned::<B>(&gguf, &plan, dtype, device, &mut progress)?;
                let warm = |model: &Llama<B>, fetch| {
                    let mut cache = model.new_cache();
                    let mut one = [SeqInput {
                        tokens: &[0],
                        cache: &mut cache,
                    }];
                    model.forward_fetch(&mut one, fetch).map(drop)
                };
                warm(&model, Fetch::Ids)?;
                // The heads' kernels (top-k, gather) compile now too; a backend whose
                // top-k fails here downloads whole rows instead of refusing to serve.
                model.choose_heads(true);
                if model.fetches_heads() {
                    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        warm(&model, Fetch::Heads(&[1.0]))
                    }));
                    if !matches!(tried, Ok(Ok(()))) {
                        tracing::warn!(
                            "the device's top-k did not run: sampled steps download whole rows"
                        );
                        model.choose_heads(false);
                    }
                }
                Ok(model)
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).map_err(|panic| {
                // Not `B::name`: it would ask the failed device again.
                EngineError::Device {
                    device: format!("{device:?}"),
                    message: panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic without a message".into()),
                }
            })??
        };
        let mut end_tokens: Vec<u32> = tokenizer.eos_id().into_iter().collect();
        for t in [
            "<|endoftext|>",
            "<|im_end|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "</s>",
        ] {
            if let Some(id) = tokenizer.token_id(t) {
                if !end_tokens.contains(&id) {
                    end_tokens.push(id);
                }
            }
        }
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(gguf.bytes());
        hasher.update(&tokenizer.fingerprint_bytes());
        let weights_fingerprint = hasher.digest();
        let fingerprint = numerics_fingerprint(weights_fingerprint, dtype, &model);
        Ok(Self {
            model,
            tokenizer: Arc::new(tokenizer),
            chat,
            end_tokens,
            weights_fingerprint,
            weights: dtype,
            fingerprint,
            prefix: Mutex::new(PrefixCache::new(0)),
            step_tokens: AtomicUsize::new(0),
            downloaded_rows: AtomicUsize::new(0),
            guides: OnceLock::new(),
        })
    }

    /// Sets the most tokens one [`Engine::step`] runs through the model (0: no limit,
    /// the default). Every sequence that is generating runs its one token; prompts take
    /// what is left, in order, and a prompt longer than that is run in chunks over
    /// several steps (chunked prefill), yielding its first token after its last chunk.
    /// A long prompt then holds the other streams up for a bounded step, not for its
    /// whole prefill. If generating sequences alone fill the budget, the first prompt
    /// still runs a block's worth of tokens, so that every prompt advances.
    ///
    /// Chunking changes no numbers: a prompt row's kernels and attention depend on its
    /// own sequence alone, whatever else shares its step.
    pub fn set_step_tokens(&self, tokens: usize) {
        self.step_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Rows of logits the device engine has downloaded so far, a whole row each (the
    /// host engine's logits are host memory: none). A step downloads ids and heads, and
    /// whole rows only for the draws that need them.
    pub fn downloaded_rows(&self) -> usize {
        self.downloaded_rows.load(Ordering::Relaxed)
    }

    /// Sets the prefix cache's budget in bytes (0 disables it and frees what it holds).
    /// Both engines use it; the device engine keeps its blocks on the device.
    pub fn set_prefix_cache(&self, bytes: usize) {
        self.prefix_cache().set_budget(bytes);
    }

    /// The prefix cache's counters and size.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix_cache().stats()
    }

    fn prefix_cache(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        // The cache holds no invariant a panic elsewhere could break half-way.
        self.prefix.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes the sequences started from now on keep their keys and values on the host as
    /// `dtype` (see [`KvDtype`]); the prefix cache's blocks, of the type before, are
    /// dropped.
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        if dtype != self.model.kv_dtype() {
            self.model.set_kv_dtype(dtype);
            self.fingerprint =
                numerics_fingerprint(self.weights_fingerprint, self.weights, &self.model);
            let mut prefix = self.prefix_cache();
            *prefix = PrefixCache::new(prefix.budget());
        }
    }

    /// The network.
    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model fingerprint: the weight file and tokenizer, and the arithmetic they run
    /// with (the weights' format in memory; on the host path, the KV cache's type). The
    /// root of every stream's hash chain: two workers agree on a stream's state, and one
    /// takes over the other's stream, only when their fingerprints are equal.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Tokens that end a completion.
    pub fn end_tokens(&self) -> &[u32] {
        &self.end_tokens
    }

    /// Longest sequence (prompt and output) the engine runs.
    pub fn context_length(&self) -> usize {
        self.model.config().served_context()
    }

    /// Renders and tokenizes a prompt.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        match prompt {
            Prompt::Text(t) => Ok(self.tokenizer.encode(t, true)?),
            Prompt::Chat(messages) => self.encode_chat(messages, true),
        }
    }

    /// Renders chat messages with the model's template and tokenizes them; with
    /// `add_generation_prompt` the prompt ends with what opens the assistant's turn.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_with(messages, None, add_generation_prompt)
    }

    /// [`Engine::encode_chat`] offering `tools` (OpenAI's array) to the model, in its
    /// own format ([`ChatTemplate::render_tools`]).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_as(messages, tools, add_generation_prompt, false)
    }

    /// [`Engine::encode_chat_with`]; special tokens spelled in the messages' text
    /// (`<|im_start|>system`) are read as plain text unless `trusted`: only the template
    /// writes turns.
    pub fn encode_chat_as(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        trusted: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let chat = self.chat.as_ref().ok_or(EngineError::NoChatTemplate)?;
        let text = chat.render_tools(messages, tools, add_generation_prompt)?;
        if !trusted {
            self.refuse_special_fields(messages, tools)?;
        }
        let writes = |m: &ChatMessage| self.tokenizer.writes_special(&m.content);
        if trusted || !messages.iter().any(writes) {
            // The template writes any BOS itself.
            return Ok(self.tokenizer.encode(&text, false)?);
        }
        let marked = chat.render_marked(messages, tools, add_generation_prompt)?;
        let guarded = message_spans(&text, &marked, messages, writes)
            .map_err(EngineError::UnguardedContent)?;
        Ok(self.tokenizer.encode_guarded(&text, &guarded)?)
    }

    /// Refuses special tokens spelled in what a client gives besides messages' text and
    /// the template writes: roles, tool calls and their ids, the tools offered.
    fn refuse_special_fields(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<(), EngineError> {
        let spelled = |text: &str| self.tokenizer.writes_special(text);
        for (i, m) in messages.iter().enumerate() {
            let call_text = |c: &super::chat::ChatToolCall| {
                format!("{} {} {}", c.id, c.function.name, c.function.arguments)
            };
            let bad = if spelled(&m.role) {
                Some("role")
            } else if m.tool_call_id.as_deref().is_some_and(spelled) {
                Some("tool_call_id")
            } else if m.tool_calls.iter().any(|c| spelled(&call_text(c))) {
                Some("tool_calls")
            } else {
                None
            };
            if let Some(field) = bad {
                return Err(EngineError::SpecialText(format!(
                    "the {field} of message {i}"
                )));
            }
        }
        if tools.is_some_and(|t| spelled(&t.to_string())) {
            return Err(EngineError::SpecialText("the tools offered".into()));
        }
        Ok(())
    }

    /// How the model calls tools (by its chat template).
    pub fn tool_format(&self) -> ToolFormat {
        self.chat
            .as_ref()
            .map_or(ToolFormat::Generic, ChatTemplate::tool_format)
    }

    /// Starts a sequence after checking the request against the model's limits.
    pub fn start(
        &self,
        prompt_ids: Vec<u32>,
        params: GenerateParams,
    ) -> Result<Sequence<B>, EngineError> {
        params.sampling.validate()?;
        if params.max_tokens == 0 && params.prompt_logprobs.is_none() {
            return Err(EngineError::ZeroMaxTokens);
        }
        if prompt_ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let context = self.context_length();
        if prompt_ids.len() >= context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt_ids.len(),
                context,
            });
        }
        let vocab = self.model.config().vocab;
        if let Some(&id) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ForwardError::BadToken { id, vocab }.into());
        }
        let named = params
            .sampling
            .logit_bias
            .iter()
            .map(|b| ("logit_bias", b.0))
            .chain(params.stop_token_ids.iter().map(|&t| ("stop_token_ids", t)));
        for (field, id) in named {
            if id as usize >= vocab {
                return Err(EngineError::TokenOutOfVocab { field, id, vocab });
            }
        }
        for n in [params.logprobs, params.prompt_logprobs]
            .into_iter()
            .flatten()
        {
            if n > MAX_TOP_LOGPROBS {
                return Err(EngineError::TooManyLogprobs(n));
            }
        }
        let mut guide = match &params.grammar {
            None => None,
            Some(g) => Some(self.guide(g)?),
        };
        let mut tools = None;
        if let Some(t) = &params.tools {
            let format = self.tool_format();
            let forced = baton_common::tools::grammar(&t.functions, &t.choice, t.parallel, format)
                .map_err(|e| EngineError::Grammar(e.to_string()))?;
            if let Some(g) = forced {
                if guide.is_some() {
                    return Err(EngineError::Grammar(
                        "a tool choice and a response format both constrain the output; ask for one"
                            .into(),
                    ));
                }
                guide = Some(self.guide(&g)?);
            }
            tools = Some(ToolParser::new(format));
        }
        let mut cache = self.model.new_cache();
        cache.set_decode_from(prompt_ids.len());
        cache.expect_positions(
            prompt_ids
                .len()
                .saturating_add(params.max_tokens)
                .min(context),
        );
        Ok(Sequence {
            cache,
            pending: prompt_ids.clone(),
            stops: StopMatcher::new(&params.stop),
            prompt_ids,
            generated: Vec::new(),
            params,
            text: String::new(),
            calls: Vec::new(),
            text_chars: 0,
            decoder: Some(StreamDecoder::new(self.tokenizer.clone()).skip_special(true)),
            finish: None,
            guide,
            tools,
            failure: None,
            reused: 0,
            prompt_scores: Vec::new(),
            prompt_scored: false,
            reported: 0,
        })
    }

    /// A fresh matcher of `grammar` over this model's vocabulary.
    fn guide(&self, grammar: &Grammar) -> Result<Guide, EngineError> {
        let guides = self.guides.get_or_init(|| {
            Guides::new(
                self.tokenizer.clone(),
                &self.end_tokens,
                self.model.config().vocab,
            )
        });
        match guides {
            Ok(guides) => guides.start(grammar).map_err(EngineError::Grammar),
            Err(e) => Err(EngineError::Grammar(format!(
                "the model's vocabulary cannot be used for grammars: {e}"
            ))),
        }
    }

    /// Continues a sequence whose first `tokens` were generated elsewhere (a stream
    /// resumed from a checkpoint): they are replayed through the stop conditions and the
    /// text decoder without sampling, and run through the model with the prompt at the
    /// next step. The sequence is then in the state an uninterrupted run had after
    /// `tokens`; with the counter-based sampler it goes on to the same tokens.
    pub fn resume(
        &self,
        prompt_ids: Vec<u32>,
        tokens: &[u32],
        params: GenerateParams,
    ) -> Result<Sequence<B>, EngineError> {
        let mut seq = self.start(prompt_ids, params)?;
        let vocab = self.model.config().vocab;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ForwardError::BadToken { id, vocab }.into());
        }
        for (i, &id) in tokens.iter().enumerate() {
            if seq.finish.is_some() {
                return Err(EngineError::ResumePastEnd {
                    index: i,
                    tokens: tokens.len(),
                });
            }
            seq.commit(self, id)?;
            if let Some(message) = seq.failure.take() {
                return Err(EngineError::ResumeOffGrammar { index: i, message });
            }
        }
        seq.pending.extend_from_slice(tokens);
        Ok(seq)
    }

    /// Runs one prompt to completion, calling `on_token` for each token as it comes.
    pub fn generate(
        &self,
        prompt_ids: Vec<u32>,
        params: GenerateParams,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<Completion, EngineError> {
        let mut seq = self.start(prompt_ids, params)?;
        self.run(&mut seq, on_token)?;
        if let Some(message) = seq.failure.take() {
            return Err(EngineError::Grammar(message));
        }
        Ok(seq.into_completion())
    }

    /// Steps `seq` alone until it ends (a started or a resumed sequence), calling
    /// `on_token` for each token as it comes.
    pub fn run(
        &self,
        seq: &mut Sequence<B>,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<(), EngineError> {
        while seq.finish.is_none() {
            if let Some(ev) = self.step(&mut [&mut *seq])?.pop().flatten() {
                on_token(&ev);
            }
        }
        Ok(())
    }
}
