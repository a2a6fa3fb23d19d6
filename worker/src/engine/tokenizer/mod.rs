//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata: byte-level BPE
//! (`model` = `gpt2`: GPT-2, SmolLM2, Llama 3, Qwen) or SentencePiece (`model` = `llama`:
//! Llama 2, Mistral, Gemma; see [`spm`]).
//!
//! Encoding runs on the Hugging Face `tokenizers` crate: a BPE model over the GGUF vocabulary
//! and merges, a pre-tokenizer chosen by `tokenizer.ggml.pre` (llama.cpp's patterns, each an
//! isolating `Split`, then `ByteLevel` without its own regex), and the GGUF's control tokens
//! as special added tokens, so `<|im_start|>` is matched whole before BPE. Decoding maps each
//! token back to its bytes through GPT-2's byte alphabet (what the `ByteLevel` decoder does);
//! [`StreamDecoder`] does the same one token at a time without ever splitting a character.
//!
//! Quirks of the default model (SmolLM2), handled here:
//! - Its `pre` is `smollm`: every numeric character is cut off alone before the GPT-2 pattern
//!   runs, so whitespace is never glued to a following digit ("a  1" is `a`, `ĠĠ`, `1`). This
//!   matches SmolLM2's own `tokenizer.json` (`Digits` then `ByteLevel`) and llama.cpp.
//!   transformers' GGUF converter does not know `smollm` and splits such text differently.
//! - Its vocabulary lacks 21 of the 256 byte symbols (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, and
//!   bytes that only lead characters of planes 4 to 11 or never occur in UTF-8). Like the
//!   Hugging Face tokenizer, encoding drops those bytes.
//! - `add_bos_token` is false: the chat template writes every special token itself.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, LazyLock, OnceLock};

use aho_corasick::AhoCorasick;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::engine::gguf::{GgufError, GgufFile, MetaValue};

pub mod spm;
pub use spm::SpmParts;

/// llama.cpp's GPT-2 pre-tokenizer pattern (`llama-vocab.cpp`).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// llama.cpp's Llama 3 pattern (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`): case-insensitive
/// contractions written out, letters with one leading non-letter, digits in runs of at
/// most three, and newlines kept with the punctuation or whitespace before them.
const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's Qwen2 pattern (`LLAMA_VOCAB_PRE_TYPE_QWEN2`): Llama 3's with every digit
/// alone.
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Everything that can go wrong building a tokenizer or using it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A `tokenizer.ggml.*` key is missing or has the wrong type.
    #[error("tokenizer metadata: {0}")]
    Metadata(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer other than byte-level BPE.
    #[error("unsupported tokenizer model tokenizer.ggml.model = `{0}` (supported: gpt2, llama)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this code does not implement.
    #[error(
        "unsupported pre-tokenizer tokenizer.ggml.pre = `{0}` (supported: smollm, gpt2, \
         gpt-2, llama-bpe, llama3, llama-v3, qwen2, deepseek-r1-qwen, default)"
    )]
    UnsupportedPre(String),
    /// The vocabulary, token types, merges or special ids are inconsistent.
    #[error("invalid tokenizer vocabulary: {0}")]
    InvalidVocab(String),
    /// The `tokenizers` crate refused the model or the pre-tokenizer.
    #[error("cannot build the tokenizer: {0}")]
    Build(#[source] tokenizers::Error),
    /// The `tokenizers` crate failed to encode a text.
    #[error("cannot encode text: {0}")]
    Encode(#[source] tokenizers::Error),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    UnknownId {
        /// The id asked for.
        id: u32,
        /// How many tokens the vocabulary has.
        vocab_size: usize,
    },
}

impl TokenizerError {
    /// A stable identifier of the error kind, for logs, metrics and response bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizerError::Metadata(_) => "metadata",
            TokenizerError::UnsupportedModel(_) => "unsupported_model",
            TokenizerError::UnsupportedPre(_) => "unsupported_pre",
            TokenizerError::InvalidVocab(_) => "invalid_vocab",
            TokenizerError::Build(_) => "build",
            TokenizerError::Encode(_) => "encode",
            TokenizerError::UnknownId { .. } => "unknown_id",
        }
    }
}

/// How text is cut into pieces before BPE, named by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreTokenizer {
    /// `smollm`: every numeric character (`\p{N}`) alone, then the GPT-2 pattern.
    Smollm,
    /// `gpt2` (also `gpt-2`): the GPT-2 pattern.
    Gpt2,
    /// `llama-bpe` (also `llama3`, `llama-v3`): Llama 3's pattern; a piece that is a
    /// whole vocabulary entry is taken as it is, without merges.
    Llama3,
    /// `qwen2` (also `deepseek-r1-qwen`): Qwen2's pattern, Qwen2.5 and Qwen3 too.
    Qwen2,
    /// `default` (also used when the key is absent): llama.cpp's fallback, punctuation runs,
    /// then the GPT-2 pattern, then digit runs, then groups of three ASCII digits.
    Default,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value.
    pub fn from_gguf_name(name: &str) -> Result<Self, TokenizerError> {
        match name {
            "smollm" => Ok(PreTokenizer::Smollm),
            "gpt2" | "gpt-2" => Ok(PreTokenizer::Gpt2),
            "llama-bpe" | "llama3" | "llama-v3" => Ok(PreTokenizer::Llama3),
            "qwen2" | "deepseek-r1-qwen" => Ok(PreTokenizer::Qwen2),
            "default" => Ok(PreTokenizer::Default),
            other => Err(TokenizerError::UnsupportedPre(other.to_owned())),
        }
    }

    /// The `tokenizer.ggml.pre` value this pre-tokenizer is named by.
    pub fn gguf_name(self) -> &'static str {
        match self {
            PreTokenizer::Smollm => "smollm",
            PreTokenizer::Gpt2 => "gpt2",
            PreTokenizer::Llama3 => "llama-bpe",
            PreTokenizer::Qwen2 => "qwen2",
            PreTokenizer::Default => "default",
        }
    }

    /// Whether a piece that is itself in the vocabulary is taken whole (llama.cpp's
    /// `ignore_merges`, which Llama 3's `tokenizer.json` also sets).
    fn ignores_merges(self) -> bool {
        matches!(self, PreTokenizer::Llama3)
    }

    /// The patterns llama.cpp applies one after the other; each splits the pieces the
    /// previous ones left, keeping both matches and the text between them.
    fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Smollm => &[r"\p{N}", GPT2_PATTERN],
            PreTokenizer::Gpt2 => &[GPT2_PATTERN],
            PreTokenizer::Llama3 => &[LLAMA3_PATTERN],
            PreTokenizer::Qwen2 => &[QWEN2_PATTERN],
            PreTokenizer::Default => &[
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_PATTERN,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
        }
    }
}

/// What a vocabulary entry is (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: not set.
    Undefined,
    /// 1: an ordinary BPE token.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token such as `<|im_start|>`: matched whole, skipped by
    /// `decode(.., skip_special = true)`.
    Control,
    /// 4: a token added by the model's authors, matched whole but not special.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a raw byte (`<0x0A>`); sentencepiece vocabularies only.
    Byte,
}

impl TokenType {
    /// The type for a GGUF `token_type` value.
    pub fn from_gguf(value: i64) -> Option<Self> {
        Some(match value {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// The GGUF `token_type` value.
    pub fn gguf_value(self) -> u8 {
        match self {
            TokenType::Undefined => 0,
            TokenType::Normal => 1,
            TokenType::Unknown => 2,
            TokenType::Control => 3,
            TokenType::UserDefined => 4,
            TokenType::Unused => 5,
            TokenType::Byte => 6,
        }
    }
}

/// What a [`Tokenizer`] is built from: the values of a GGUF's `tokenizer.ggml.*` keys for a
/// byte-level BPE (`model` = `gpt2`). Tests and tiny generated models build one by hand.
#[derive(Debug, Clone)]
pub struct TokenizerParts {
    /// `pre`: how text is split before BPE.
    pub pre: PreTokenizer,
    /// `tokens`: the vocabulary, index = id, spelled in GPT-2's byte alphabet (`Ġthe`).
    pub tokens: Vec<String>,
    /// `token_type`: one per token, or empty for all [`TokenType::Normal`].
    pub token_types: Vec<TokenType>,
    /// `merges`: `"left right"` pairs, highest priority first.
    pub merges: Vec<String>,
    /// `bos_token_id`.
    pub bos_id: Option<u32>,
    /// `eos_token_id`.
    pub eos_id: Option<u32>,
    /// `unknown_token_id`.
    pub unk_id: Option<u32>,
    /// `padding_token_id`.
    pub pad_id: Option<u32>,
    /// `add_bos_token`: whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub add_bos: bool,
    /// `add_eos_token`: whether [`Tokenizer::encode`] with `add_special` appends EOS.
    pub add_eos: bool,
    /// A SentencePiece vocabulary (`model` = `llama`): its scores and space prefix. `None`
    /// for byte-level BPE. With it, `tokens` are spelled as SentencePiece spells them
    /// (`▁the`, `<0x0A>`), `merges` are not read (the scores rank them) and `pre` is not
    /// used.
    pub spm: Option<SpmParts>,
}

/// GPT-2's table from bytes to the printable characters byte-level vocabularies are spelled
/// in: printable Latin-1 bytes stand for themselves, the other 68 become U+0100..U+0143 in
/// byte order (so the space 0x20 is `Ġ`, U+0120, and the newline `Ċ`).
static BYTE_TO_CHAR: LazyLock<[char; 256]> = LazyLock::new(|| {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for (byte, slot) in (0u8..=255).zip(table.iter_mut()) {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(byte)
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("codes stay below U+0144");
    }
    table
});

/// The inverse of [`BYTE_TO_CHAR`], indexed by code point (all below U+0144).
static CHAR_TO_BYTE: LazyLock<Vec<Option<u8>>> = LazyLock::new(|| {
    let mut table = vec![None; 0x144];
    for (byte, &c) in (0u8..=255).zip(BYTE_TO_CHAR.iter()) {
        table[c as usize] = Some(byte);
    }
    table
});

fn char_to_byte(c: char) -> Option<u8> {
    CHAR_TO_BYTE.get(c as usize).copied().flatten()
}

/// The bytes a token stands for: a token spelled wholly in the byte alphabet maps back
/// character by character, any other (a control token with unusual characters, text stored
/// raw) stands for its own UTF-8. This is the rule of the `ByteLevel` decoder.
fn token_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// A token spelled in the byte alphabet, as BPE sees it: tokens already spelled that way are
/// kept, others are respelled byte by byte (what transformers' GGUF converter does).
fn byte_level_spelling(token: &str) -> String {
    if token.chars().all(|c| char_to_byte(c).is_some()) {
        token.to_owned()
    } else {
        token
            .bytes()
            .map(|b| BYTE_TO_CHAR[usize::from(b)])
            .collect()
    }
}

/// A byte-level BPE tokenizer built from a GGUF's metadata. Cheap to share: wrap it in an
/// [`Arc`] (it is `Send + Sync`).
pub struct Tokenizer {
    /// Encoder: BPE model, pre-tokenizer and special tokens.
    inner: tokenizers::Tokenizer,
    /// The pre-tokenizer, kept for [`Tokenizer::fingerprint_bytes`].
    pre: PreTokenizer,
    /// The scores and space prefix of a SentencePiece vocabulary; `None` for byte-level
    /// BPE.
    spm: Option<SpmParts>,
    /// Vocabulary as the GGUF spells it, index = id.
    tokens: Vec<String>,
    /// Token types as the GGUF gives them (all `Normal` when it gives none).
    token_types: Vec<TokenType>,
    /// Merges as the GGUF gives them, kept for [`Tokenizer::fingerprint_bytes`].
    merges: Vec<String>,
    /// The bytes every token decodes to, concatenated; token `i` is
    /// `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    /// Start of each token in `bytes`, plus the end.
    offsets: Vec<usize>,
    /// Ids registered as special (control tokens): matched whole, skippable on decode.
    special: HashSet<u32>,
    /// Finds their spellings in a text (`None`: the vocabulary has none).
    special_text: Option<AhoCorasick>,
    /// The encoder without its special tokens, for text that must not write them; made
    /// when first needed.
    plain: OnceLock<tokenizers::Tokenizer>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    unk_id: Option<u32>,
    pad_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("merges", &self.merges.len())
            .field("special", &self.special.len())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

/// The encoder of a byte-level BPE: the vocabulary respelled in the byte alphabet, the
/// file's merges, the pre-tokenizer's splits, then bytes mapped to that alphabet.
fn byte_level(
    tokens: &[String],
    merges: &[String],
    pre: PreTokenizer,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let mut vocab = Vocab::default();
    for (id, token) in (0u32..).zip(tokens) {
        vocab.insert(byte_level_spelling(token), id);
    }
    let pairs = merges
        .iter()
        .enumerate()
        .map(|(rank, merge)| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    TokenizerError::InvalidVocab(format!(
                        "merge {rank} `{merge}` is not two tokens separated by a space"
                    ))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(pre.ignores_merges())
        .build()
        .map_err(TokenizerError::Build)?;

    let mut steps = Vec::new();
    for pattern in pre.patterns() {
        let split = Split::new(
            SplitPattern::Regex((*pattern).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(TokenizerError::Build)?;
        steps.push(PreTokenizerWrapper::from(split));
    }
    // The splits above replace ByteLevel's own GPT-2 regex; it only maps bytes here.
    steps.push(ByteLevel::new(false, false, false).into());

    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(inner)
}

/// The encoder of a SentencePiece vocabulary ([`spm`]): spaces written `▁` (and one in
/// front when the vocabulary asks), no pre-tokenizer, merges ranked by score, bytes of
/// characters no token spells as byte tokens.
fn sentencepiece(
    tokens: &[String],
    types: &[TokenType],
    spm: &SpmParts,
    unk_id: Option<u32>,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    if spm.scores.len() != tokens.len() {
        return Err(TokenizerError::InvalidVocab(format!(
            "{} scores for {} tokens",
            spm.scores.len(),
            tokens.len()
        )));
    }
    let spellings: Vec<String> = tokens.iter().map(|t| spm::spelling(t)).collect();
    let merges = spm::merges(&spellings, types, &spm.scores);
    let mut vocab = Vocab::default();
    for (id, token) in (0u32..).zip(&spellings) {
        vocab.insert(token.clone(), id);
    }
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk_id {
        bpe = bpe.unk_token(tokens[unk as usize].clone());
    }
    let bpe = bpe.build().map_err(TokenizerError::Build)?;
    let mut steps: Vec<NormalizerWrapper> = Vec::new();
    if spm.add_space_prefix {
        steps.push(Prepend::new("▁".to_owned()).into());
    }
    steps.push(
        Replace::new(" ", "▁")
            .map_err(TokenizerError::Build)?
            .into(),
    );
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_normalizer(Some(NormalizerSequence::new(steps)));
    Ok(inner)
}

impl Tokenizer {
    /// Build the tokenizer a GGUF file describes (`tokenizer.ggml.model` must be `gpt2`).
    ///
    /// `add_space_prefix` is not read: llama.cpp applies it to sentencepiece vocabularies
    /// only, never to byte-level BPE.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        let sentencepiece = match model {
            "gpt2" => false,
            "llama" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        let pre = match gguf.get("tokenizer.ggml.pre") {
            None => PreTokenizer::Default,
            // llama.cpp reads no pre-tokenizer for SentencePiece vocabularies.
            Some(_) if sentencepiece => PreTokenizer::Default,
            Some(_) => PreTokenizer::from_gguf_name(gguf.get_str("tokenizer.ggml.pre")?)?,
        };
        let tokens: Vec<String> = gguf
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_owned)
            .collect();
        let token_types = match gguf.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(value) => token_types_from_meta(value)?,
        };
        let merges = if sentencepiece {
            Vec::new()
        } else {
            gguf.get_str_array("tokenizer.ggml.merges")?
                .into_iter()
                .map(str::to_owned)
                .collect()
        };
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match gguf.get(key) {
                None => Ok(None),
                Some(_) => {
                    let value = gguf.get_u64(key)?;
                    u32::try_from(value).map(Some).map_err(|_| {
                        TokenizerError::InvalidVocab(format!("{key} = {value} is out of range"))
                    })
                }
            }
        };
        // llama.cpp's defaults when a key is absent: SentencePiece vocabularies add BOS
        // and a space prefix, byte-level ones neither.
        let flag = |key: &str, default: bool| -> Result<bool, TokenizerError> {
            match gguf.get(key) {
                None => Ok(default),
                Some(_) => Ok(gguf.get_bool(key)?),
            }
        };
        let spm = if sentencepiece {
            let scores = match gguf.get("tokenizer.ggml.scores") {
                Some(MetaValue::Array(items)) => items
                    .iter()
                    .map(|v| v.as_f64().map(|f| f as f32))
                    .collect::<Option<Vec<f32>>>()
                    .ok_or_else(|| {
                        TokenizerError::InvalidVocab(
                            "tokenizer.ggml.scores holds a non-number".into(),
                        )
                    })?,
                Some(other) => {
                    return Err(TokenizerError::InvalidVocab(format!(
                        "tokenizer.ggml.scores is a {}, expected an array",
                        other.type_name()
                    )))
                }
                None => {
                    return Err(TokenizerError::InvalidVocab(
                        "a SentencePiece vocabulary needs tokenizer.ggml.scores".into(),
                    ))
                }
            };
            Some(SpmParts {
                scores,
                add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true)?,
            })
        } else {
            None
        };
        Self::from_parts(TokenizerParts {
            pre,
            tokens,
            token_types,
            merges,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token", sentencepiece)?,
            add_eos: flag("tokenizer.ggml.add_eos_token", false)?,
            spm,
        })
    }

    /// Build the tokenizer from its parts (what [`Tokenizer::from_gguf`] reads).
    ///
    /// Checks that token types (when given) match the vocabulary in number, that special ids
    /// are in range and that every merge is `"left right"`; the `tokenizers` crate checks
    /// that both sides of a merge and their concatenation are in the vocabulary.
    pub fn from_parts(parts: TokenizerParts) -> Result<Self, TokenizerError> {
        let TokenizerParts {
            pre,
            tokens,
            mut token_types,
            merges,
            bos_id,
            eos_id,
            unk_id,
            pad_id,
            add_bos,
            add_eos,
            spm,
        } = parts;
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(TokenizerError::InvalidVocab(format!(
                "{n} tokens (need at least one, at most 2^32 - 1)"
            )));
        }
        if token_types.is_empty() {
            token_types = vec![TokenType::Normal; n];
        } else if token_types.len() != n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} token types for {n} tokens",
                token_types.len()
            )));
        }
        for (name, id) in [
            ("bos", bos_id),
            ("eos", eos_id),
            ("unk", unk_id),
            ("pad", pad_id),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{name} id {id} is outside the vocabulary of {n} tokens"
                )));
            }
        }
        if add_bos && bos_id.is_none() {
            return Err(TokenizerError::InvalidVocab(
                "add_bos_token is set but there is no bos_token_id".to_owned(),
            ));
        }
        if add_eos && eos_id.is_none() {
            return Err(TokenizerError::InvalidVocab(
                "add_eos_token is set but there is no eos_token_id".to_owned(),
            ));
        }

        // A vocabulary may repeat a spelling; like llama.cpp and transformers, the last id
        // wins for encoding, while every id still decodes.
        let mut inner = match &spm {
            None => byte_level(&tokens, &merges, pre)?,
            Some(spm) => sentencepiece(&tokens, &token_types, spm, unk_id)?,
        };

        // Control tokens become special added tokens, user-defined ones plain added tokens:
        // both are matched whole before pre-tokenization. As in transformers' converter, a
        // byte-level control token not spelled in the byte alphabet is a mislabelled text
        // token and is left to BPE, and so is a user-defined one (its stored spelling is
        // not a vocabulary key after respelling).
        let in_alphabet = |t: &str| spm.is_some() || t.chars().all(|c| char_to_byte(c).is_some());
        let mut special = HashSet::new();
        let mut control = Vec::new();
        let mut spellings = Vec::new();
        let mut user_defined = Vec::new();
        for ((id, token), ty) in (0u32..).zip(&tokens).zip(&token_types) {
            if !in_alphabet(token) {
                continue;
            }
            match ty {
                TokenType::Control => {
                    special.insert(id);
                    spellings.push(token.as_str());
                    control.push(AddedToken::from(token.clone(), true).normalized(false));
                }
                TokenType::UserDefined => {
                    user_defined.push(AddedToken::from(token.clone(), false).normalized(false));
                }
                _ => {}
            }
        }
        inner.add_special_tokens(&control);
        inner.add_tokens(&user_defined);

        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for (token, &ty) in tokens.iter().zip(&token_types) {
            match &spm {
                None => bytes.extend_from_slice(&token_bytes(token)),
                Some(_) => bytes.extend_from_slice(&spm::token_bytes(token, ty)),
            }
            offsets.push(bytes.len());
        }

        let special_text = match spellings.is_empty() {
            true => None,
            false => Some(
                AhoCorasick::new(&spellings)
                    .map_err(|e| TokenizerError::InvalidVocab(format!("special tokens: {e}")))?,
            ),
        };
        Ok(Tokenizer {
            special_text,
            plain: OnceLock::new(),
            inner,
            spm,
            pre,
            tokens,
            token_types,
            merges,
            bytes,
            offsets,
            special,
            bos_id,
            eos_id,
            unk_id,
            pad_id,
            add_bos,
            add_eos,
        })
    }

    /// Token ids for `text`. Special tokens written in the text (`<|im_start|>`) are matched
    /// whole, always: rendered chat prompts rely on it. With `add_special`, BOS is prepended
    /// and EOS appended when the model asks for them (`add_bos_token` / `add_eos_token`;
    /// SmolLM2 asks for neither).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(TokenizerError::Encode)?;
        let body = encoding.get_ids();
        let mut ids = Vec::with_capacity(body.len() + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(body);
        if add_special && self.add_eos {
            ids.extend(self.eos_id);
        }
        Ok(ids)
    }

    /// Whether `text` spells a special token (`<|im_end|>`).
    pub fn writes_special(&self, text: &str) -> bool {
        self.special_text.as_ref().is_some_and(|a| a.is_match(text))
    }

    /// Token ids for `text` (as [`Tokenizer::encode`] without BOS/EOS), where special
    /// tokens spelled inside the byte ranges `guarded` are read as plain text: a chat
    /// prompt's messages are the client's, and a client must not write turns of its own.
    /// The text is cut at the special tokens outside `guarded` only, and each piece between
    /// them encoded without special tokens, as the tokenizer encodes the pieces between
    /// special tokens anyway: text outside the messages keeps its ids.
    pub fn encode_guarded(
        &self,
        text: &str,
        guarded: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(TokenizerError::Encode)?;
        let plain = self.plain.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        let piece = |from: usize, to: usize, ids: &mut Vec<u32>| {
            if from < to {
                let encoding = plain
                    .encode_fast(&text[from..to], false)
                    .map_err(TokenizerError::Encode)?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Ok::<(), TokenizerError>(())
        };
        let mut ids = Vec::with_capacity(encoding.len());
        let mut from = 0;
        for (&id, &(start, end)) in encoding.get_ids().iter().zip(encoding.get_offsets()) {
            let inside = guarded.iter().any(|g| g.start < end && start < g.end);
            if !self.special.contains(&id) || inside {
                continue;
            }
            piece(from, start, &mut ids)?;
            ids.push(id);
            from = end;
        }
        piece(from, text.len(), &mut ids)?;
        Ok(ids)
    }

    /// The text of `ids`; byte sequences that are not UTF-8 become U+FFFD. With
    /// `skip_special`, control tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes token `id` stands for (possibly part of a UTF-8 character).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&start), Some(&end)) => Ok(&self.bytes[start..end]),
            _ => Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.tokens.len(),
            }),
        }
    }

    /// How many tokens the vocabulary has (the model's logit count).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The end-of-sequence token, if the model has one. For SmolLM2 this is `<|im_end|>`
    /// (id 2), where chat generation stops.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The unknown token, if the model has one.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// The padding token, if the model has one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The id of a token as the vocabulary spells it (`Ġthe`, `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The spelling of token `id` in the vocabulary.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Whether `id` is a special (control) token such as `<|im_start|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// A canonical serialisation of everything that decides how text maps to ids, to
    /// fingerprint a model: equal tokenizers give equal bytes, whatever the GGUF's key order.
    ///
    /// Layout (integers little-endian, strings as a `u32` byte length then UTF-8):
    /// `b"baton-tokenizer/1\n"`; model `"gpt2"` or `"llama"`; pre-tokenizer name; `u32` token count, then
    /// per token its type (`u8`) and spelling; `u32` merge count, then each merge; the bos,
    /// eos, unk and pad ids as `u32` (`u32::MAX` when absent); `add_bos` and `add_eos` as one
    /// byte each; for a SentencePiece vocabulary then each score's `f32` bits and
    /// `add_space_prefix` as a byte.
    pub fn fingerprint_bytes(&self) -> Vec<u8> {
        fn put_str(out: &mut Vec<u8>, s: &str) {
            put_len(out, s.len());
            out.extend_from_slice(s.as_bytes());
        }
        fn put_len(out: &mut Vec<u8>, n: usize) {
            let n = u32::try_from(n).expect("lengths were checked to fit in u32");
            out.extend_from_slice(&n.to_le_bytes());
        }
        let mut out = Vec::with_capacity(self.bytes.len() * 3);
        out.extend_from_slice(b"baton-tokenizer/1\n");
        put_str(&mut out, if self.spm.is_some() { "llama" } else { "gpt2" });
        put_str(&mut out, self.pre.gguf_name());
        put_len(&mut out, self.tokens.len());
        for (token, ty) in self.tokens.iter().zip(&self.token_types) {
            out.push(ty.gguf_value());
            put_str(&mut out, token);
        }
        put_len(&mut out, self.merges.len());
        for merge in &self.merges {
            put_str(&mut out, merge);
        }
        for id in [self.bos_id, self.eos_id, self.unk_id, self.pad_id] {
            out.extend_from_slice(&id.unwrap_or(u32::MAX).to_le_bytes());
        }
        out.push(u8::from(self.add_bos));
        out.push(u8::from(self.add_eos));
        if let Some(spm) = &self.spm {
            for score in &spm.scores {
                out.extend_from_slice(&score.to_bits().to_le_bytes());
            }
            out.push(u8::from(spm.add_space_prefix));
        }
        out
    }
}

/// `tokenizer.ggml.token_type`: an array of integers.
fn token_types_from_meta(value: &MetaValue) -> Result<Vec<TokenType>, TokenizerError> {
    let items = value.as_array().ok_or_else(|| {
        TokenizerError::InvalidVocab(format!(
            "tokenizer.ggml.token_type is a {}, expected an array",
            value.type_name()
        ))
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_i64().and_then(TokenType::from_gguf).ok_or_else(|| {
                TokenizerError::InvalidVocab(format!("token {i} has token type {item:?}"))
            })
        })
        .collect()
}

/// Turns generated ids into text as they arrive, for streaming. Each [`StreamDecoder::push`]
/// returns the text that is now final: bytes of a character split over several tokens are
/// held back until the character is complete, so no partial character is ever emitted.
/// Bytes that can never become UTF-8 are emitted as U+FFFD, as [`Tokenizer::decode`] does, so
/// the pieces always add up to `decode` of all the ids.
///
/// Owns an [`Arc`] of the tokenizer so a sequence's decoder can live in a slot table beside
/// it.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    /// Bytes of an unfinished character (at most three).
    pending: Vec<u8>,
    /// Whether control tokens are left out of the text.
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder that emits every token, special ones included.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
            skip_special: false,
        }
    }

    /// Leave special (control) tokens out of the text, or not.
    pub fn skip_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Add one token; returns the text that became final (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        if self.skip_special && self.tokenizer.is_special(id) {
            return Ok(String::new());
        }
        self.pending
            .extend_from_slice(self.tokenizer.token_bytes(id)?);
        Ok(take_complete(&mut self.pending))
    }

    /// Whether bytes of an unfinished character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The end of the stream: what is still held back, an unfinished character as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// Removes from `buf` and returns everything up to an unfinished character at its end;
/// invalid sequences become U+FFFD exactly as `String::from_utf8_lossy` would make them.
fn take_complete(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    while start < buf.len() {
        match std::str::from_utf8(&buf[start..]) {
            Ok(text) => {
                out.push_str(text);
                start = buf.len();
            }
            Err(err) => {
                let valid = start + err.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&buf[start..valid]).expect("valid_up_to is valid UTF-8"),
                );
                match err.error_len() {
                    Some(len) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = valid + len;
                    }
                    // An unfinished character at the end: keep it for the next token.
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        assert_eq!(BYTE_TO_CHAR[usize::from(b' ')], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[usize::from(b'\n')], 'Ċ');
        assert_eq!(BYTE_TO_CHAR[usize::from(b'a')], 'a');
        assert_eq!(BYTE_TO_CHAR[0], '\u{100}');
        assert_eq!(BYTE_TO_CHAR[0xAD], '\u{143}');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(BYTE_TO_CHAR[usize::from(b)]), Some(b));
        }
        assert_eq!(char_to_byte('é'), Some(0xE9));
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte(' '), None);
    }

    #[test]
    fn tokens_outside_the_alphabet_are_respelled_for_bpe_and_decode_raw() {
        assert_eq!(byte_level_spelling("Ġthe"), "Ġthe");
        assert_eq!(byte_level_spelling("a b"), "aĠb");
        assert_eq!(token_bytes("Ġthe"), b" the");
        assert_eq!(token_bytes("a b"), b"a b");
        assert_eq!(token_bytes("Ã©"), "é".as_bytes());
    }

    #[test]
    fn take_complete_keeps_only_an_unfinished_tail() {
        let mut buf = "aé".as_bytes().to_vec();
        buf.push(0xE2);
        assert_eq!(take_complete(&mut buf), "aé");
        assert_eq!(buf, [0xE2]);
        buf.extend_from_slice(&[0x82, 0xAC]);
        assert_eq!(take_complete(&mut buf), "€");
        assert!(buf.is_empty());
        buf.extend_from_slice(&[0xFF, b'x', 0xF0, 0x9F]);
        assert_eq!(take_complete(&mut buf), "\u{FFFD}x");
        assert_eq!(buf, [0xF0, 0x9F]);
    }
}
