//! The Llama network and its batched forward pass.

use std::sync::Arc;

use burn_tensor::{backend::Backend, Int, Tensor, TensorData};

use super::{
    attention::{AttendWith, Attention, SeqSpan},
    cache::{KvCache, KvDtype},
    config::LlamaConfig,
    host::HostLogits,
    linear::{to_host, Linear},
    mlp::Mlp,
    rope::Rope,
};
use crate::engine::cpu::qmatrix::QMatrix;

/// Why a forward pass was refused. Checked before any tensor work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ForwardError {
    /// A sequence brought no new tokens.
    #[error("sequence {0} has no tokens to process")]
    Empty(usize),
    /// The sequence would run past the model's context.
    #[error("sequence {seq} needs {needed} positions but the context holds {context}")]
    ContextExceeded {
        /// Index of the sequence in the batch.
        seq: usize,
        /// Positions the sequence would occupy.
        needed: usize,
        /// The model's context length.
        context: usize,
    },
    /// A token id is not in the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken {
        /// The offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// Root-mean-square layer norm.
#[derive(Debug, Clone)]
pub struct RmsNorm<B: Backend> {
    /// `[1, hidden]` scale.
    pub(crate) weight: Tensor<B, 2>,
    /// The same scale on the host, for the host forward path.
    pub(crate) host: Vec<f32>,
    pub(crate) eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    /// `x: [rows, hidden]` → normalised rows scaled by the weight.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let inv_rms = x
            .clone()
            .powi_scalar(2)
            .mean_dim(1)
            .add_scalar(self.eps)
            .sqrt()
            .recip();
        x * inv_rms * self.weight.clone()
    }
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct Block<B: Backend> {
    pub(crate) attn_norm: RmsNorm<B>,
    pub(crate) attn: Attention<B>,
    /// Norm of the attention's output before the residual add (Gemma 3).
    pub(crate) post_attn_norm: Option<RmsNorm<B>>,
    pub(crate) ffn_norm: RmsNorm<B>,
    pub(crate) mlp: Mlp<B>,
    /// Norm of the feed-forward block's output before the residual add (Gemma 3).
    pub(crate) post_ffn_norm: Option<RmsNorm<B>>,
}

/// The token embedding table, `[vocab, hidden]`.
#[derive(Debug, Clone)]
pub enum Embedding<B: Backend> {
    /// A tensor on the device, in the weight dtype.
    Dense(Tensor<B, 2>),
    /// GGUF blocks in host memory; looked-up rows are dequantized.
    Quant(Arc<QMatrix>),
}

/// New tokens of one sequence and the cache holding what came before them.
pub struct SeqInput<'a, B: Backend> {
    /// Tokens to run, at positions `cache.len()..`.
    pub tokens: &'a [u32],
    /// The sequence's cache; extended by the forward pass.
    pub cache: &'a mut KvCache<B>,
}

/// A Llama-family network whose weights are shared by every sequence it serves.
#[derive(Debug, Clone)]
pub struct Llama<B: Backend> {
    pub(crate) config: LlamaConfig,
    /// The token embedding.
    pub(crate) embed: Embedding<B>,
    /// The output projection. Tied models (SmolLM2 among them) have no `output.weight`:
    /// this is then a transposed view of `embed`, sharing its memory.
    pub(crate) lm_head: Linear<B>,
    pub(crate) blocks: Vec<Block<B>>,
    pub(crate) norm: RmsNorm<B>,
    pub(crate) rope: Rope<B>,
    /// The rotations of sliding-window layers, when they have a base of their own.
    pub(crate) rope_local: Option<Rope<B>>,
    pub(crate) device: B::Device,
    /// Run block-form weights through the burn path too (tests compare the two paths).
    pub(crate) force_burn: bool,
    /// How new caches keep keys and values on the host.
    pub(crate) kv_dtype: KvDtype,
    /// Whether the backend finds rows' heads ([`Fetch::Heads`]); found out at load.
    pub(crate) heads: bool,
}

impl<B: Backend> Llama<B> {
    /// The network's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Bytes of weights one decode step reads: every matrix once (the embedding lookup
    /// reads one row and is not counted).
    pub fn decode_weight_bytes(&self) -> usize {
        self.lm_head.weight_bytes()
            + self
                .blocks
                .iter()
                .map(|b| {
                    b.attn.qkv.weight_bytes()
                        + b.attn.out.weight_bytes()
                        + b.mlp.gate_up.weight_bytes()
                        + b.mlp.down.weight_bytes()
                })
                .sum::<usize>()
    }

    /// How the host path keeps its matrices: each distinct sequence of block formats
    /// (runs of a stack in order), sorted; empty off the host path. Part of the
    /// numerics fingerprint: the same file kept in other forms runs other arithmetic.
    pub fn held_formats(&self) -> String {
        let Some(w) = self.host_weights() else {
            return String::new();
        };
        let mut all: Vec<String> = w
            .matrices()
            .map(|m| {
                let kinds: Vec<String> = m.kinds().iter().map(|k| format!("{k:?}")).collect();
                kinds.join("+")
            })
            .collect();
        all.sort();
        all.dedup();
        all.join(",")
    }

    /// Whether the forward pass runs on the host (every matrix in block form): its KV
    /// caches are then host vectors, which the prefix cache can copy.
    pub fn host_path(&self) -> bool {
        !self.force_burn && self.host_weights().is_some()
    }

    /// Whether [`Fetch::Heads`] downloads rows' heads on the device path: on cubecl's
    /// backends once their kernels compiled at load; elsewhere it downloads the rows.
    pub fn fetches_heads(&self) -> bool {
        self.heads
    }

    /// Decides whether [`Fetch::Heads`] finds rows' heads on this backend: on cubecl's
    /// (CUDA, wgpu), whose logits live in device memory and which have a top-k kernel;
    /// not on flex, whose rows are host memory already (and which has no top-k).
    pub(crate) fn choose_heads(&mut self) {
        self.heads = !self.host_path()
            && self.config.vocab > HEAD
            && B::name(&self.device).contains("cubecl<");
    }

    /// How new caches keep keys and values on the host path.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Makes new caches keep keys and values as `dtype` (caches made before keep theirs;
    /// a step must not mix the two).
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        self.kv_dtype = dtype;
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.config.n_layers, self.kv_dtype)
    }

    /// Runs the new tokens of every sequence in one pass — linear layers over all rows
    /// at once, attention per sequence against its own cache — and returns the logits
    /// of each sequence's last new token, `[sequences, vocab]`.
    pub fn forward(&self, seqs: &mut [SeqInput<'_, B>]) -> Result<Tensor<B, 2>, ForwardError> {
        Ok(match self.forward_any(seqs)? {
            Logits::Host(HostLogits { logits: flat, .. }) => {
                let n = flat.len() / self.config.vocab;
                Tensor::from_data(TensorData::new(flat, [n, self.config.vocab]), &self.device)
            }
            Logits::Device(t) => t,
        })
    }

    /// [`Llama::forward`], with the logits on the host: `[sequences × vocab]`, row-major
    /// (the host path hands over its own buffer; nothing is copied), and the index of
    /// each row's largest logit (the lowest among equals, what
    /// [`crate::engine::sampler::argmax`] gives) where the forward pass found it as it
    /// wrote the logits (the host path) or where `logits` is false (the device path
    /// then finds it on the device and downloads the ids alone: the logits are empty).
    pub fn forward_greedy(
        &self,
        seqs: &mut [SeqInput<'_, B>],
        logits: bool,
    ) -> Result<(Vec<f32>, Option<Vec<u32>>), ForwardError> {
        let fetch = if logits { Fetch::Logits } else { Fetch::Ids };
        let out = self.forward_fetch(seqs, fetch)?;
        Ok((out.logits, out.argmax))
    }

    /// [`Llama::forward`], handing back what `fetch` asks of the logits. The host path
    /// has every row on the host and gives the logits and the argmax whatever is asked;
    /// the device path downloads only what is asked, and with [`Fetch::Heads`] keeps
    /// the logits on the device for [`StepLogits::fetch_logits`].
    pub fn forward_fetch(
        &self,
        seqs: &mut [SeqInput<'_, B>],
        fetch: Fetch,
    ) -> Result<StepLogits<B>, ForwardError> {
        Ok(match self.forward_any(seqs)? {
            Logits::Host(HostLogits { logits, argmax }) => StepLogits {
                logits,
                argmax: Some(argmax),
                heads: None,
                device: None,
            },
            Logits::Device(t) => match fetch {
                Fetch::Ids => StepLogits {
                    logits: Vec::new(),
                    argmax: Some(device_argmax(t)),
                    heads: None,
                    device: None,
                },
                Fetch::Heads if self.heads => {
                    let (argmax, heads) = device_heads(t.clone());
                    StepLogits {
                        logits: Vec::new(),
                        argmax: Some(argmax),
                        heads: Some(heads),
                        device: Some(t),
                    }
                }
                Fetch::Heads | Fetch::Logits => StepLogits {
                    logits: to_host(t),
                    argmax: None,
                    heads: None,
                    device: None,
                },
            },
        })
    }

    fn forward_any(&self, seqs: &mut [SeqInput<'_, B>]) -> Result<Logits<B>, ForwardError> {
        let context = self.config.context_length.min(self.rope.max_positions());
        let mut spans = Vec::with_capacity(seqs.len());
        let mut ids = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ForwardError::Empty(i));
            }
            let needed = s.cache.len() + s.tokens.len();
            if needed > context {
                return Err(ForwardError::ContextExceeded {
                    seq: i,
                    needed,
                    context,
                });
            }
            for &t in s.tokens {
                if t as usize >= self.config.vocab {
                    return Err(ForwardError::BadToken {
                        id: t,
                        vocab: self.config.vocab,
                    });
                }
                ids.push(t as i32);
            }
            spans.push(SeqSpan {
                row: ids.len() - s.tokens.len(),
                len: s.tokens.len(),
                pos: s.cache.len(),
            });
        }
        let mut caches: Vec<&mut KvCache<B>> = seqs.iter_mut().map(|s| &mut *s.cache).collect();
        let logits = match self.host_weights() {
            Some(w) if !self.force_burn => {
                Logits::Host(self.forward_host(&w, &ids, &spans, &mut caches))
            }
            _ => Logits::Device(self.forward_burn(ids, &spans, &mut caches)),
        };
        for (cache, span) in caches.iter_mut().zip(&spans) {
            cache.advance(span.len);
        }
        Ok(logits)
    }

    /// The forward pass with burn tensor operations, for weights kept as tensors.
    fn forward_burn(
        &self,
        ids: Vec<i32>,
        spans: &[SeqSpan],
        caches: &mut [&mut KvCache<B>],
    ) -> Tensor<B, 2> {
        let rows = ids.len();
        let mut x = match &self.embed {
            Embedding::Dense(table) => {
                let ids =
                    Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows]), &self.device);
                table.clone().select(0, ids).cast(burn_tensor::DType::F32)
            }
            Embedding::Quant(table) => {
                let mut values = Vec::with_capacity(rows * self.config.hidden);
                for &id in &ids {
                    values.extend(table.row(id as usize));
                }
                Tensor::from_data(
                    TensorData::new(values, [rows, self.config.hidden]),
                    &self.device,
                )
            }
        };
        if self.config.embed_scale != 1.0 {
            x = x.mul_scalar(self.config.embed_scale);
        }
        let post = |norm: &Option<RmsNorm<B>>, t: Tensor<B, 2>| match norm {
            Some(n) => n.forward(t),
            None => t,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = block.attn_norm.forward(x.clone());
            let (rope, window) = self.layer_rope(layer);
            let how = AttendWith {
                rope,
                scale: self.config.attn_scale,
                window,
            };
            let a = block.attn.forward(layer, h, spans, caches, &how);
            x = x + post(&block.post_attn_norm, a);
            let h = block.ffn_norm.forward(x.clone());
            x = x + post(&block.post_ffn_norm, block.mlp.forward(h));
        }
        let last = if spans.len() == 1 && spans[0].len == 1 {
            x
        } else {
            let picked: Vec<_> = spans
                .iter()
                .map(|s| x.clone().narrow(0, s.row + s.len - 1, 1))
                .collect();
            Tensor::cat(picked, 0)
        };
        self.lm_head.forward(self.norm.forward(last))
    }

    /// The rotations of layer `layer`, and its window when it is a sliding-window layer.
    pub(crate) fn layer_rope(&self, layer: usize) -> (&Rope<B>, Option<usize>) {
        match self.config.sliding {
            Some(s) if self.config.is_local(layer) => (
                self.rope_local.as_ref().unwrap_or(&self.rope),
                Some(s.window),
            ),
            _ => (&self.rope, None),
        }
    }

    /// Copies logits `[sequences, vocab]` to the host, one vector per sequence.
    pub fn logits_to_host(logits: Tensor<B, 2>) -> Vec<Vec<f32>> {
        let [n, vocab] = logits.dims();
        let flat = to_host(logits);
        (0..n)
            .map(|i| flat.get(i * vocab..(i + 1) * vocab).unwrap_or(&[]).to_vec())
            .collect()
    }
}

/// Each row's largest logit's index, found on the device: only the ids are downloaded.
pub(crate) fn device_argmax<B: Backend>(logits: Tensor<B, 2>) -> Vec<u32> {
    let [n, _] = logits.dims();
    logits
        .argmax(1)
        .reshape([n])
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("argmax ids")
        .into_iter()
        .map(|i| i as u32)
        .collect()
}

/// How many of each row's largest logits [`Fetch::Heads`] downloads. Draws cut to a
/// `top_k` below it are decided by them alone, as are draws whose candidates within
/// 42 of the largest (at their temperature) are fewer. The device's top-k is a kernel
/// whose size is fixed at compile time, unrolled over the selection, so it stays small.
pub const HEAD: usize = 64;

/// What a forward pass hands back of each row's logits ([`Llama::forward_fetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    /// Each row's argmax: the device path downloads the ids alone.
    Ids,
    /// The argmax, and each row's [`HEAD`] largest logits with their ids
    /// ([`StepLogits::heads`]); the device path leaves the rest on the device.
    Heads,
    /// Every logit.
    Logits,
}

/// Some of a row's largest logits, as [`crate::engine::sampler::SamplingParams::pick_from_top`]
/// takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    /// `(id, logit)` of the row's [`HEAD`] largest logits, in no particular order (ties
    /// at the edge parted either way).
    pub top: Vec<(u32, f32)>,
    /// Whether every logit of the row is finite (the draw from `top` assumes it).
    pub finite: bool,
}

/// A step's logits, as [`Llama::forward_fetch`] hands them back.
#[derive(Debug)]
pub struct StepLogits<B: Backend> {
    /// `[sequences × vocab]`, row-major; empty where they were not downloaded.
    pub logits: Vec<f32>,
    /// Each row's largest logit's index (the lowest among equals), where found.
    pub argmax: Option<Vec<u32>>,
    /// Each row's head, where [`Fetch::Heads`] downloaded them.
    pub heads: Option<Vec<Head>>,
    /// The logits still on the device, for [`StepLogits::fetch_logits`].
    device: Option<Tensor<B, 2>>,
}

impl<B: Backend> StepLogits<B> {
    /// Downloads every row's logits into [`StepLogits::logits`] if they are not there
    /// yet (a draw its head did not decide needs the whole row).
    pub fn fetch_logits(&mut self) {
        if let Some(t) = self.device.take().filter(|_| self.logits.is_empty()) {
            self.logits = to_host(t);
        }
    }
}

/// Each row's argmax and its [`HEAD`] largest logits and ids, found on the device
/// (`logits` has more than [`HEAD`] columns): one download of ids (with a count of the
/// row's non-finite logits) and one of values.
fn device_heads<B: Backend>(logits: Tensor<B, 2>) -> (Vec<u32>, Vec<Head>) {
    let [n, _] = logits.dims();
    let ids = logits.clone().argtopk(HEAD, 1);
    let values = logits.clone().gather(1, ids.clone());
    let argmax = logits.clone().argmax(1);
    let odd = logits.is_finite().bool_not().int().sum_dim(1);
    let ints = Tensor::cat(vec![ids, odd, argmax], 1)
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("head ids");
    let values = to_host(values);
    let width = HEAD + 2;
    let argmax = ints
        .chunks_exact(width)
        .map(|r| r[HEAD + 1] as u32)
        .collect();
    let heads = ints
        .chunks_exact(width)
        .zip(values.chunks_exact(HEAD))
        .map(|(row, values)| Head {
            top: row[..HEAD]
                .iter()
                .zip(values)
                .map(|(&id, &v)| (id as u32, v))
                .collect(),
            finite: row[HEAD] == 0,
        })
        .collect();
    debug_assert_eq!(ints.len(), n * width);
    (argmax, heads)
}

/// Logits where a forward pass left them.
enum Logits<B: Backend> {
    /// `[sequences × vocab]`, row-major, from the host path, with each row's argmax.
    Host(HostLogits),
    /// `[sequences, vocab]` from the burn path.
    Device(Tensor<B, 2>),
}
