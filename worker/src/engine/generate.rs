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

    /// Sets the prefix cache's budget in bytes (0 disables it and frees what it holds).
    /// Only the host forward path (weights in block form) uses it; with the burn path
    /// (`f32`, `f16`, cuda) every prompt is run in full whatever the budget.
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

    /// Advances every unfinished sequence by one token with one forward pass, and
    /// returns the token event of each (in order; `None` for sequences already finished,
    /// and for a prompt that ran only a chunk of itself under the step budget, see
    /// [`Engine::set_step_tokens`]).
    pub fn step(
        &self,
        seqs: &mut [&mut Sequence<B>],
    ) -> Result<Vec<Option<TokenEvent>>, EngineError> {
        use super::llama::SeqInput;
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].finish.is_none())
            .collect();
        let mut events = vec![None; seqs.len()];
        if active.is_empty() {
            return Ok(events);
        }
        let prefix = self.prefix_cache().enabled();
        // Sequences looked up in the prefix cache now: positions reused, and positions
        // that could have been (counted once it runs or reuses something; a prompt that
        // found nothing and waits under the step budget is looked up again next step,
        // when the prompts that ran before it may have stored what it needs).
        let mut looked: Vec<(usize, usize, usize)> = Vec::new();
        if prefix {
            let mut cache = self.prefix_cache();
            for &i in &active {
                let s = &mut *seqs[i];
                // A scored prompt needs the logits of every position it holds.
                if !s.cache.is_empty() || s.params.prompt_logprobs.is_some() {
                    continue;
                }
                let hashes = block_hashes(self.fingerprint, &s.pending);
                // The last token always runs: its logits give the first output token.
                let candidates = s.pending.len() - 1;
                let usable = candidates / BLOCK_TOKENS;
                let found = cache.lookup(&hashes[..usable]);
                let mut loaded = 0;
                for &h in &hashes[..found] {
                    let kv = cache.get(h).expect("lookup found it");
                    if !s.cache.push_span(BLOCK_TOKENS, BLOCK_TOKENS, kv) {
                        break;
                    }
                    loaded += BLOCK_TOKENS;
                }
                // Then the leading positions of a cached block that follows the last one
                // found and begins with the same tokens.
                if loaded == found * BLOCK_TOKENS && loaded < candidates {
                    let parent = match found {
                        0 => root(self.fingerprint),
                        n => hashes[n - 1],
                    };
                    if let Some((h, n)) = cache.partial(parent, &s.pending[loaded..candidates]) {
                        let kv = cache.get(h).expect("partial found it");
                        if s.cache.push_span(BLOCK_TOKENS, n, kv) {
                            loaded += n;
                        }
                    }
                }
                looked.push((i, loaded, candidates));
                s.pending.drain(..loaded);
                s.reused = s.reused.max(loaded.min(s.prompt_ids.len()));
            }
        }
        // How many pending tokens each sequence runs this step: one for each generating
        // sequence, then what the step's budget leaves, prompt by prompt.
        let budget = match self.step_tokens.load(Ordering::Relaxed) {
            0 => usize::MAX,
            n => n,
        };
        let generating = active
            .iter()
            .filter(|&&i| seqs[i].pending.len() == 1)
            .count();
        let mut left = budget.saturating_sub(generating);
        let mut prompt_ran = false;
        let runs: Vec<(usize, usize)> = active
            .iter()
            .filter_map(|&i| {
                let s = &seqs[i];
                let mut n = s.pending.len();
                if n == 1 || s.scoring() {
                    return Some((i, 1));
                }
                if !self.model.host_path() {
                    // The device engine's prompt rows and decode rows round differently
                    // (other product and attention shapes), so a resume's replayed
                    // tokens run as they first ran: the prompt as prompt rows, then
                    // each generated token as a decode row, one a step.
                    let (done, prompt) = (s.cache.len(), s.prompt_ids.len());
                    n = n.min(prompt.saturating_sub(done).max(1));
                }
                let mut take = n.min(left);
                if take == 0 && !prompt_ran {
                    take = n.min(BLOCK_TOKENS);
                }
                left = left.saturating_sub(take);
                prompt_ran |= take > 0;
                (take > 0).then_some((i, take))
            })
            .collect();
        if !looked.is_empty() {
            let mut cache = self.prefix_cache();
            for (i, loaded, candidates) in looked {
                if loaded > 0 || runs.iter().any(|&(r, _)| r == i) {
                    cache.record(loaded, candidates);
                }
            }
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            // The forward pass's rows: one per generating sequence, the rest prompts'.
            let rows: usize = runs.iter().map(|r| r.1).sum();
            let prompts = runs.iter().filter(|r| r.1 > 1).count();
            tracing::debug!(rows, generating, prompts, "forward");
        }
        // Where every row that draws is greedy, the device engine downloads ids only;
        // where the others draw from the model's logits as they are, the heads of the
        // rows first (the rest stays on the device unless a head does not decide a draw).
        let scored: Vec<bool> = runs.iter().map(|&(i, _)| seqs[i].scoring()).collect();
        let temperatures: Vec<f32> = runs
            .iter()
            .map(|&(i, _)| {
                let s = &*seqs[i];
                match s.params.sampling.temperature {
                    t if t > 0.0 && s.plain() => t,
                    _ => 1.0,
                }
            })
            .collect();
        let fetch = if scored.iter().any(|&s| s) {
            Fetch::Logits
        } else if runs.iter().all(|&(i, _)| seqs[i].plain_greedy()) {
            Fetch::Ids
        } else if runs.iter().all(|&(i, _)| seqs[i].plain()) {
            Fetch::Heads(&temperatures)
        } else {
            Fetch::Logits
        };
        // The grammar masks of the rows that draw are computed on a thread of their own
        // while the forward pass runs: they depend on the tokens so far only.
        let (forward, computed) = {
            let mut inputs: Vec<SeqInput<'_, B>> = Vec::with_capacity(runs.len());
            let mut guides: Vec<(usize, &mut Guide)> = Vec::new();
            let mut rest: Vec<Option<&mut Sequence<B>>> =
                seqs.iter_mut().map(|s| Some(&mut **s)).collect();
            for (r, &(i, take)) in runs.iter().enumerate() {
                let s = rest[i].take().expect("each index once");
                if take == s.pending.len() {
                    if let Some(guide) = s.guide.as_mut() {
                        guides.push((r, guide));
                    }
                }
                inputs.push(SeqInput {
                    tokens: &s.pending[..take],
                    cache: &mut s.cache,
                });
            }
            if guides.is_empty() {
                (self.model.forward_fetch(&mut inputs, fetch), Vec::new())
            } else {
                std::thread::scope(|scope| {
                    let masker = scope.spawn(move || {
                        guides
                            .into_iter()
                            .map(|(r, g)| (r, g.mask()))
                            .collect::<Vec<_>>()
                    });
                    let forward = self.model.forward_fetch(&mut inputs, fetch);
                    let masks = masker
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    (forward, masks)
                })
            }
        };
        let mut forward = forward?;
        // Draws at a temperature, and logprobs, decided by their rows' heads (see
        // `SamplingParams::pick_from_top`, `logprobs_from_top`); any other needs every
        // logit of the step.
        let count = self.model.config().vocab;
        let from_heads: Vec<Option<(u32, Option<Logprobs>)>> = runs
            .iter()
            .enumerate()
            .map(|(r, &(i, take))| {
                let s = &*seqs[i];
                let head = forward.heads.as_ref()?.get(r).filter(|h| h.finite)?;
                if take < s.pending.len() || s.plain_greedy() || !s.plain() {
                    return None;
                }
                let position = (s.prompt_ids.len() + s.generated.len()) as u64;
                let sampling = &s.params.sampling;
                let id = if sampling.temperature == 0.0 {
                    *forward.argmax.as_ref()?.get(r)?
                } else {
                    sampling.pick_from_top(&head.top, count, Some(&head.rest), position)?
                };
                let logprobs = match s.params.logprobs {
                    None => None,
                    Some(n) => {
                        let (logprob, top) = super::sampler::logprobs_from_top(
                            &head.top,
                            head.rest.ties,
                            head.below_at_one,
                            id,
                            n,
                        )?;
                        Some(Logprobs {
                            logprob,
                            top,
                            text_offset: 0,
                        })
                    }
                };
                Some((id, logprobs))
            })
            .collect();
        if forward.heads.is_some() {
            // Only the rows whose draw their head left undecided come down.
            let wanted: Vec<bool> = runs
                .iter()
                .zip(&from_heads)
                .map(|(&(i, take), drawn)| {
                    let s = &*seqs[i];
                    drawn.is_none() && take == s.pending.len() && !s.plain_greedy()
                })
                .collect();
            forward.fetch_rows(&wanted);
        }
        let greedy = forward.argmax.take();
        let mut masks: Vec<Option<Result<toktrie::SimpleVob, String>>> =
            runs.iter().map(|_| None).collect();
        for (r, mask) in computed {
            masks[r] = Some(mask.and_then(|m| {
                if m.is_zero() {
                    Err("the grammar allows no token here".to_string())
                } else {
                    Ok(m)
                }
            }));
        }
        let mut rows = forward.rows_mut();
        // A scored prompt's row: the next prompt token's log-probability, from the logits
        // as the model gave them.
        for ((&(i, _), row), _) in runs.iter().zip(&rows).zip(&scored).filter(|x| *x.1) {
            let s = &mut *seqs[i];
            let next = s.prompt_ids[s.cache.len()];
            let top = s.params.prompt_logprobs.unwrap_or(0);
            let (logprob, top) = super::sampler::logprobs(row, next, top);
            s.prompt_scores.push(Logprobs {
                logprob,
                top,
                text_offset: 0,
            });
        }
        // Every draw depends only on its own row, parameters, history and position, so
        // several run in parallel on the compute threads (a draw at temperature > 0 sorts
        // most of the vocabulary); the commits then run in order. A prompt that ran only
        // a chunk draws nothing: the logits of a chunk's last row are not its prompt's.
        // A greedy draw without a penalty is the row's argmax, which the host forward
        // pass found as it wrote the row: reading 16 rows of logits again, from the
        // caches of the threads that wrote them, took ~0.4 ms of a 16-sequence step.
        let draws: Vec<(usize, Drawn)> = {
            let mut jobs: Vec<Draw<'_>> = runs
                .iter()
                .zip(rows.iter_mut())
                .zip(masks)
                .enumerate()
                .filter(|(_, (((i, take), _), _))| {
                    *take == seqs[*i].pending.len() && seqs[*i].params.max_tokens > 0
                })
                .map(|(r, ((&(i, _), row), mask))| {
                    let s = &*seqs[i];
                    let known = greedy
                        .as_ref()
                        .filter(|_| s.plain_greedy())
                        .and_then(|g| g.get(r).map(|&id| (id, None)))
                        .or_else(|| from_heads[r].clone());
                    Draw {
                        seq: i,
                        params: &s.params,
                        prompt: &s.prompt_ids,
                        output: &s.generated,
                        banned: s.banned(self),
                        row,
                        known,
                        mask,
                    }
                })
                .collect();
            if jobs.len() > 1 && jobs.iter().any(|j| j.params.sampling.temperature > 0.0) {
                use rayon::prelude::*;
                jobs.par_iter_mut().map(Draw::run).collect()
            } else {
                jobs.iter_mut().map(Draw::run).collect()
            }
        };
        for &(i, take) in &runs {
            if take < seqs[i].pending.len() {
                seqs[i].pending.drain(..take);
            } else if seqs[i].params.max_tokens == 0 {
                // A prompt scored and nothing asked of it beyond.
                seqs[i].finish = Some(FinishReason::MaxTokens);
                seqs[i].decoder = None;
            }
        }
        for (i, drawn) in draws {
            match drawn {
                Ok((id, logprobs)) => {
                    let mut event = seqs[i].take(self, id)?;
                    event.logprobs = logprobs.map(|l| Logprobs {
                        text_offset: seqs[i].text_chars - event.text.chars().count(),
                        ..l
                    });
                    events[i] = Some(event);
                }
                Err(message) => seqs[i].fail(message),
            }
        }
        if prefix {
            // The full blocks of every prompt (or replay) that ran this step, and of
            // every sequence that finished.
            let mut cache = self.prefix_cache();
            for &(i, take) in &runs {
                let s = &*seqs[i];
                if take > 1 || s.finish.is_some() && s.cache.len() >= BLOCK_TOKENS {
                    store_blocks(&mut cache, self.fingerprint, &s.cache, &s.cached_tokens());
                }
            }
        }
        Ok(events)
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

/// What a row's draw gave: the token and its logprobs, or why no token may be drawn.
type Drawn = Result<(u32, Option<Logprobs>), String>;

/// One row's draw: everything it reads, so that draws run in parallel.
struct Draw<'a> {
    /// The sequence's index in the step.
    seq: usize,
    params: &'a GenerateParams,
    prompt: &'a [u32],
    output: &'a [u32],
    /// Tokens that may not be drawn yet ([`GenerateParams::min_tokens`]).
    banned: Vec<u32>,
    row: &'a mut [f32],
    /// The draw (and its logprobs, where asked) where the forward pass found it: the
    /// row's argmax, or what its head decided.
    known: Option<(u32, Option<Logprobs>)>,
    /// The grammar's mask, where the sequence has one.
    mask: Option<Result<toktrie::SimpleVob, String>>,
}

impl Draw<'_> {
    /// The grammar's mask and the bans, then the sampler's adjustments; the logprobs
    /// (when asked) from the row as the draw sees it.
    fn run(&mut self) -> (usize, Drawn) {
        if let Some(known) = self.known.take() {
            return (self.seq, Ok(known));
        }
        if self.row.is_empty() {
            // A draw its head left undecided whose row stayed on the device: an error,
            // never a draw from nothing.
            return (
                self.seq,
                Err("the row of logits for this draw was not fetched".into()),
            );
        }
        let constrained = self.mask.is_some() || !self.banned.is_empty();
        match &self.mask {
            Some(Err(e)) => return (self.seq, Err(e.clone())),
            Some(Ok(m)) => apply_mask(m, self.row),
            None => {}
        }
        let mut lifted: Vec<(usize, f32)> = Vec::with_capacity(self.banned.len());
        for &t in &self.banned {
            if let Some(l) = self.row.get_mut(t as usize) {
                lifted.push((t as usize, *l));
                *l = f32::NEG_INFINITY;
            }
        }
        if !lifted.is_empty() && super::sampler::first_max(self.row).is_none() {
            // The grammar allows nothing but what min_tokens bans (its end): it ends.
            for (t, l) in lifted {
                self.row[t] = l;
            }
        }
        let sampling = &self.params.sampling;
        sampling.adjust(self.row, self.prompt, self.output);
        if constrained && super::sampler::first_max(self.row).is_none() {
            return (self.seq, Err("no token is allowed here".into()));
        }
        // The position of the token drawn: what its draw is keyed by.
        let position = (self.prompt.len() + self.output.len()) as u64;
        let id = sampling.pick(self.row, position);
        let logprobs = self.params.logprobs.map(|top| {
            let (logprob, top) = super::sampler::logprobs(self.row, id, top);
            Logprobs {
                logprob,
                top,
                text_offset: 0,
            }
        });
        (self.seq, Ok((id, logprobs)))
    }
}

/// Stores the full blocks of `kv`, whose positions hold `tokens` (block *i* is positions
/// `16i..16i + 16`, named by the chain's hash after them), last to first, so that a
/// run's first block is its most recently used and the last to be evicted.
fn store_blocks<B: Backend>(
    cache: &mut PrefixCache,
    fingerprint: u64,
    kv: &KvCache<B>,
    tokens: &[u32],
) {
    let hashes = block_hashes(fingerprint, tokens);
    let full = (kv.len() / BLOCK_TOKENS).min(hashes.len());
    for (b, &h) in hashes[..full].iter().enumerate().rev() {
        if !cache.touch(h) {
            if let Some(values) = kv.span(b * BLOCK_TOKENS, BLOCK_TOKENS) {
                let parent = match b {
                    0 => root(fingerprint),
                    b => hashes[b - 1],
                };
                let block: [u32; BLOCK_TOKENS] = tokens[b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS]
                    .try_into()
                    .expect("a block's worth");
                cache.insert(h, parent, block, values);
            }
        }
    }
}

/// One request in flight.
pub struct Sequence<B: Backend> {
    cache: KvCache<B>,
    /// Tokens not yet run through the model (the prompt, then each sampled token).
    pending: Vec<u32>,
    prompt_ids: Vec<u32>,
    generated: Vec<u32>,
    params: GenerateParams,
    stops: StopMatcher,
    /// Text emitted so far.
    text: String,
    /// Tool calls found so far.
    calls: Vec<ToolCall>,
    /// Its length in characters.
    text_chars: usize,
    /// Turns ids into whole characters as they come; taken when the sequence ends.
    decoder: Option<StreamDecoder>,
    finish: Option<FinishReason>,
    /// The request's grammar, where it has one.
    guide: Option<Guide>,
    /// Finds tool calls in the output, when the request offers tools.
    tools: Option<ToolParser>,
    /// Why the grammar ended the sequence ([`FinishReason::GrammarFailed`]).
    failure: Option<String>,
    /// Prompt tokens whose keys and values came from the prefix cache.
    reused: usize,
    /// The scored prompt's entries so far ([`GenerateParams::prompt_logprobs`]).
    prompt_scores: Vec<Logprobs>,
    /// Whether they were taken.
    prompt_scored: bool,
    /// Positions last reported by [`Sequence::progress`].
    reported: usize,
}

impl<B: Backend> Sequence<B> {
    /// The tokens whose keys and values the KV cache holds: the prompt, then the
    /// generated tokens, as far as the cache reaches.
    fn cached_tokens(&self) -> Vec<u32> {
        self.prompt_ids
            .iter()
            .chain(&self.generated)
            .take(self.cache.len())
            .copied()
            .collect()
    }

    /// Why the sequence ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tool calls found in the output so far.
    pub fn tool_calls(&self) -> u32 {
        self.tools.as_ref().map_or(0, ToolParser::calls)
    }

    /// What went wrong when it ended with [`FinishReason::GrammarFailed`].
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    fn fail(&mut self, message: String) {
        self.failure = Some(message);
        self.finish = Some(FinishReason::GrammarFailed);
        self.decoder = None;
    }

    /// Prompt tokens whose keys and values came from the prefix cache instead of running
    /// through the model.
    pub fn reused_prompt_tokens(&self) -> usize {
        self.reused
    }

    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt_ids.len()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// The KV cache (its length is the number of positions processed).
    pub fn cache(&self) -> &KvCache<B> {
        &self.cache
    }

    /// Whether its next row is a scored prompt's, with a prompt token after it.
    fn scoring(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.cache.len() + 1 < self.prompt_ids.len()
    }

    /// The scored prompt's entries, once its whole prompt has run (then never again):
    /// the log-probability of each prompt token after the first given those before it.
    pub fn take_prompt_scores(&mut self) -> Option<Vec<Logprobs>> {
        let done = self.cache.len() >= self.prompt_ids.len();
        if self.params.prompt_logprobs.is_none() || self.prompt_scored || !done {
            return None;
        }
        self.prompt_scored = true;
        Some(std::mem::take(&mut self.prompt_scores))
    }

    /// The positions its KV cache holds, when they grew since the last call: a step that
    /// ran a chunk of its prompt and gave no token still shows the sequence moving.
    pub fn progress(&mut self) -> Option<u32> {
        let at = self.cache.len();
        (at > self.reported).then(|| {
            self.reported = at;
            at as u32
        })
    }

    /// The prompt's token ids.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    /// Whether its next draw is from the logits as the model gives them (no penalty,
    /// bias, grammar or ban): its row's head may decide it and give its logprobs.
    fn plain(&self) -> bool {
        !self.params.sampling.adjusts()
            && self.guide.is_none()
            && self.generated.len() >= self.params.min_tokens
    }

    /// Whether its next draw is the argmax of the logits as the model gives them, and
    /// nothing else is asked of the row.
    fn plain_greedy(&self) -> bool {
        self.plain() && self.params.sampling.temperature == 0.0 && self.params.logprobs.is_none()
    }

    /// The tokens its next draw may not pick: while the output is shorter than
    /// `min_tokens`, those that would end it.
    fn banned(&self, engine: &Engine<B>) -> Vec<u32> {
        if self.generated.len() >= self.params.min_tokens {
            return Vec::new();
        }
        let mut banned = self.params.stop_token_ids.clone();
        if !self.params.ignore_eos || self.guide.is_some() {
            banned.extend_from_slice(&engine.end_tokens);
        }
        banned
    }

    /// Takes `id`, drawn from this sequence's logits, as its next token and applies the
    /// stop conditions.
    fn take(&mut self, engine: &Engine<B>, id: u32) -> Result<TokenEvent, EngineError> {
        self.pending.clear();
        self.pending.push(id);
        self.commit(engine, id)
    }

    /// Appends `id` to the output and applies the stop conditions; returns the token's
    /// event. The same for a sampled token and for one replayed on resume, so that a
    /// resumed sequence is in exactly the state the original was.
    fn commit(&mut self, engine: &Engine<B>, id: u32) -> Result<TokenEvent, EngineError> {
        let index = self.generated.len();
        self.generated.push(id);

        // Under a grammar an end token is drawn only where the grammar may end, and ends.
        // A stop token ends the output whatever `ignore_eos` says.
        let is_end = ((!self.params.ignore_eos || self.guide.is_some())
            && engine.end_tokens.contains(&id))
            || self.params.stop_token_ids.contains(&id);
        if let Some(guide) = self.guide.as_mut().filter(|_| !is_end) {
            if let Err(e) = guide.consume(id) {
                self.fail(format!("token {index} (id {id}): {e}"));
                return Ok(TokenEvent {
                    index,
                    id,
                    text: String::new(),
                    logprobs: None,
                    tool_calls: Vec::new(),
                });
            }
        }
        let mut text = String::new();
        if is_end {
            self.finish = Some(FinishReason::Eos);
        } else if let Some(decoder) = self.decoder.as_mut() {
            let fresh = decoder.push(id)?;
            if self.generated.len() < self.params.min_tokens {
                // Stop strings are looked for once the output is long enough.
                text = fresh;
            } else if !fresh.is_empty() {
                let out = self.stops.push(&fresh);
                text = out.emit;
                if out.stopped {
                    self.finish = Some(FinishReason::StopString);
                }
            }
        }
        if self.finish.is_none() {
            if self.guide.as_ref().is_some_and(Guide::is_stopped) {
                self.finish = Some(FinishReason::Eos);
            } else if self.generated.len() >= self.params.max_tokens {
                self.finish = Some(FinishReason::MaxTokens);
            } else if self.prompt_ids.len() + self.generated.len() >= engine.context_length() {
                self.finish = Some(FinishReason::ContextFull);
            }
        }
        if let Some(reason) = self.finish {
            // Release what is still pending: a trailing partial character, and text the
            // stop matcher held back (unless a stop string ended the completion).
            let rest = self
                .decoder
                .take()
                .map(StreamDecoder::finish)
                .unwrap_or_default();
            if reason != FinishReason::StopString {
                let out = self.stops.push(&rest);
                text.push_str(&out.emit);
                if out.stopped {
                    self.finish = Some(FinishReason::StopString);
                } else {
                    text.push_str(&self.stops.finish());
                }
            }
        }
        let mut tool_calls = Vec::new();
        if let Some(parser) = self.tools.as_mut() {
            let mut parsed = parser.push(&text);
            if self.finish.is_some() {
                let last = parser.finish();
                parsed.content.push_str(&last.content);
                parsed.calls.extend(last.calls);
            }
            text = parsed.content;
            tool_calls = parsed.calls;
            for piece in &tool_calls {
                baton_common::tools::merge(&mut self.calls, piece.clone());
            }
        }
        self.text.push_str(&text);
        self.text_chars += text.chars().count();
        Ok(TokenEvent {
            index,
            id,
            text,
            logprobs: None,
            tool_calls,
        })
    }

    /// The finished completion.
    pub fn into_completion(self) -> Completion {
        Completion {
            prompt_ids: self.prompt_ids,
            ids: self.generated,
            text: self.text,
            tool_calls: self.calls,
            finish: self.finish.unwrap_or(FinishReason::MaxTokens),
            prompt_logprobs: self.prompt_scores,
        }
    }
}
