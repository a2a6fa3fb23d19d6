//! The Llama network and its batched forward pass, on one of two engines chosen at
//! load: the host engine ([`HostLlama`]: the file's blocks and Baton's CPU kernels,
//! host KV vectors) for weights kept in block form, and the device engine
//! ([`BurnLlama`]: burn tensors on the backend's device, a device KV store) for weights
//! kept as tensors. [`Llama`] holds one of them; each makes and takes caches of its own
//! store ([`KvCache`]). An enum rather than a type parameter: the serving stack above
//! stays one type per backend, and the choice is still made once.

use burn_tensor::{backend::Backend, Int, Tensor, TensorData};

use super::{
    super::sampler::Rest,
    attention::{AttendWith, Attention, SeqSpan, StepMasks},
    cache::{DeviceKvCache, HostKvCache, KvCache, KvDtype},
    config::LlamaConfig,
    host::{HostLlama, HostLogits},
    linear::{to_host, Linear},
    mlp::Mlp,
    rope::Rope,
};

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
    /// A sequence's cache was made by the other engine (its keys and values are not
    /// where this one keeps them).
    #[error("sequence {0} brought a cache of the other engine")]
    ForeignCache(usize),
}

/// Root-mean-square layer norm.
#[derive(Debug, Clone)]
pub struct RmsNorm<B: Backend> {
    /// `[1, hidden]` scale.
    pub(crate) weight: Tensor<B, 2>,
    pub(crate) eps: f32,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm scaling by `weight`.
    pub fn new(weight: Vec<f32>, eps: f32, device: &B::Device) -> Self {
        let hidden = weight.len();
        Self {
            weight: Tensor::from_data(TensorData::new(weight, [1, hidden]), device),
            eps,
        }
    }

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

/// New tokens of one sequence and the cache holding what came before them.
pub struct SeqInput<'a, B: Backend> {
    /// Tokens to run, at positions `cache.len()..`.
    pub tokens: &'a [u32],
    /// The sequence's cache; extended by the forward pass.
    pub cache: &'a mut KvCache<B>,
}

/// The device engine's network: every weight a burn tensor on `device`.
#[derive(Debug, Clone)]
pub struct BurnLlama<B: Backend> {
    pub(crate) config: LlamaConfig,
    /// The token embedding, `[vocab, hidden]`, in the weight dtype.
    pub(crate) embed: Tensor<B, 2>,
    /// The output projection. Tied models (SmolLM2 among them) have no `output.weight`:
    /// this is then a transposed view of `embed`, sharing its memory.
    pub(crate) lm_head: Linear<B>,
    pub(crate) blocks: Vec<Block<B>>,
    pub(crate) norm: RmsNorm<B>,
    pub(crate) rope: Rope<B>,
    /// The rotations of sliding-window layers, when they have a base of their own.
    pub(crate) rope_local: Option<Rope<B>>,
    pub(crate) device: B::Device,
    /// Whether [`Fetch::Heads`] finds rows' heads on the device; found out at load.
    pub(crate) heads: bool,
}

/// The engine a [`Llama`] runs on.
#[derive(Debug, Clone)]
pub(crate) enum Net<B: Backend> {
    /// Block weights and the CPU kernels.
    Host(HostLlama),
    /// Burn tensors on the backend's device.
    Device(BurnLlama<B>),
}

/// A Llama-family network whose weights are shared by every sequence it serves, on the
/// engine its weight format chose at load.
#[derive(Debug, Clone)]
pub struct Llama<B: Backend> {
    pub(crate) net: Net<B>,
    /// Where the device engine's tensors live, and the logits [`Llama::forward`] returns.
    pub(crate) device: B::Device,
    /// How new caches keep keys and values.
    pub(crate) kv_dtype: KvDtype,
}

impl<B: Backend> Llama<B> {
    /// The network's shape.
    pub fn config(&self) -> &LlamaConfig {
        match &self.net {
            Net::Host(m) => &m.config,
            Net::Device(m) => &m.config,
        }
    }

    /// The device the weights live on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Bytes of weights one decode step reads: every matrix once (the embedding lookup
    /// reads one row and is not counted).
    pub fn decode_weight_bytes(&self) -> usize {
        match &self.net {
            Net::Host(m) => m.decode_weight_bytes(),
            Net::Device(m) => {
                m.lm_head.weight_bytes()
                    + m.blocks
                        .iter()
                        .map(|b| {
                            b.attn.qkv.weight_bytes()
                                + b.attn.out.weight_bytes()
                                + b.mlp.gate_up.weight_bytes()
                                + b.mlp.down.weight_bytes()
                        })
                        .sum::<usize>()
            }
        }
    }

    /// How the engine keeps its matrices: on the host engine each distinct sequence of
    /// block formats (runs of a stack in order), on the device engine each tensor form
    /// (`f16`, `q8_0` blocks, …); sorted, joined by commas. Part of the numerics
    /// fingerprint: the same file kept in other forms runs other arithmetic.
    pub fn held_formats(&self) -> String {
        match &self.net {
            Net::Host(m) => m.held_formats(),
            Net::Device(m) => {
                let mut all: Vec<&str> = std::iter::once(&m.lm_head)
                    .chain(
                        m.blocks
                            .iter()
                            .flat_map(|b| [&b.attn.qkv, &b.attn.out, &b.mlp.gate_up, &b.mlp.down]),
                    )
                    .map(Linear::held)
                    .collect();
                all.sort_unstable();
                all.dedup();
                all.join(",")
            }
        }
    }

    /// Whether the host engine runs the model (every matrix in block form): its KV
    /// caches are then host vectors.
    pub fn host_path(&self) -> bool {
        matches!(self.net, Net::Host(_))
    }

    /// Whether [`Fetch::Heads`] downloads rows' heads on the device engine: on cubecl's
    /// backends once their kernels compiled at load; elsewhere it downloads the rows.
    pub fn fetches_heads(&self) -> bool {
        matches!(&self.net, Net::Device(m) if m.heads)
    }

    /// Decides whether [`Fetch::Heads`] finds rows' heads on this backend: on cubecl's
    /// (CUDA, wgpu), whose logits live in device memory and which have a top-k kernel;
    /// not on flex, whose rows are host memory already (and which has no top-k); never
    /// on the host engine, whose rows are on the host.
    pub(crate) fn choose_heads(&mut self, on: bool) {
        if let Net::Device(m) = &mut self.net {
            m.heads = on && m.config.vocab > HEAD && B::name(&self.device).contains("cubecl<");
        }
    }

    /// How new caches keep keys and values.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Makes new caches keep keys and values as `dtype` (caches made before keep theirs;
    /// a step must not mix the two).
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        self.kv_dtype = dtype;
    }

    /// A fresh cache for one sequence, in the store of the engine that runs the model.
    pub fn new_cache(&self) -> KvCache<B> {
        let (layers, dtype) = (self.config().n_layers, self.kv_dtype);
        match self.net {
            Net::Host(_) => KvCache::Host(HostKvCache::new(layers, dtype)),
            Net::Device(_) => KvCache::Device(DeviceKvCache::new(layers, dtype)),
        }
    }

    /// Runs the new tokens of every sequence in one pass — linear layers over all rows
    /// at once, attention per sequence against its own cache — and returns the logits
    /// of each sequence's last new token, `[sequences, vocab]`.
    pub fn forward(&self, seqs: &mut [SeqInput<'_, B>]) -> Result<Tensor<B, 2>, ForwardError> {
        Ok(match self.forward_any(seqs)? {
            Logits::Host(HostLogits { logits: flat, .. }) => {
                let n = flat.len() / self.config().vocab;
                Tensor::from_data(
                    TensorData::new(flat, [n, self.config().vocab]),
                    &self.device,
                )
            }
            Logits::Device(t) => t,
        })
    }

    /// [`Llama::forward`], with the logits on the host: `[sequences × vocab]`, row-major
    /// (the host engine hands over its own buffer; nothing is copied), and the index of
    /// each row's largest logit (the lowest among equals, what
    /// [`crate::engine::sampler::argmax`] gives) where the forward pass found it as it
    /// wrote the logits (the host engine) or where `logits` is false (the device engine
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

    /// [`Llama::forward`], handing back what `fetch` asks of the logits. The host engine
    /// has every row on the host and gives the logits and the argmax whatever is asked;
    /// the device engine downloads only what is asked, and with [`Fetch::Ids`] and
    /// [`Fetch::Heads`] keeps the logits on the device for [`StepLogits::fetch_rows`].
    pub fn forward_fetch(
        &self,
        seqs: &mut [SeqInput<'_, B>],
        fetch: Fetch<'_>,
    ) -> Result<StepLogits<B>, ForwardError> {
        let rows = seqs.len();
        Ok(match self.forward_any(seqs)? {
            Logits::Host(HostLogits { logits, argmax }) => StepLogits {
                logits,
                argmax: Some(argmax),
                heads: None,
                device: None,
                held: None,
                rows,
                downloaded: 0,
            },
            Logits::Device(t) => match fetch {
                Fetch::Ids => StepLogits {
                    logits: Vec::new(),
                    argmax: Some(device_argmax(t.clone())),
                    heads: None,
                    device: Some(t),
                    held: None,
                    rows,
                    downloaded: 0,
                },
                Fetch::Heads(temperatures) if self.fetches_heads() => {
                    let (argmax, heads) = device_heads(t.clone(), temperatures);
                    StepLogits {
                        logits: Vec::new(),
                        argmax: Some(argmax),
                        heads: Some(heads),
                        device: Some(t),
                        held: None,
                        rows,
                        downloaded: 0,
                    }
                }
                Fetch::Heads(_) | Fetch::Logits => StepLogits {
                    logits: to_host(t),
                    argmax: None,
                    heads: None,
                    device: None,
                    held: None,
                    rows,
                    downloaded: rows,
                },
            },
        })
    }

    /// Positions a sequence may reach: the model's context within its RoPE tables.
    fn context(&self) -> usize {
        let tables = match &self.net {
            Net::Host(m) => m.rope.max_positions(),
            Net::Device(m) => m.rope.max_positions(),
        };
        self.config().context_length.min(tables)
    }

    fn forward_any(&self, seqs: &mut [SeqInput<'_, B>]) -> Result<Logits<B>, ForwardError> {
        let context = self.context();
        let vocab = self.config().vocab;
        let host = self.host_path();
        let mut spans = Vec::with_capacity(seqs.len());
        let mut ids = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ForwardError::Empty(i));
            }
            if s.cache.is_host() != host {
                return Err(ForwardError::ForeignCache(i));
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
                if t as usize >= vocab {
                    return Err(ForwardError::BadToken { id: t, vocab });
                }
                ids.push(t as i32);
            }
            spans.push(SeqSpan {
                row: ids.len() - s.tokens.len(),
                len: s.tokens.len(),
                pos: s.cache.len(),
            });
        }
        // Every cache is of this engine: checked above.
        Ok(match &self.net {
            Net::Host(m) => {
                let mut caches: Vec<&mut HostKvCache> =
                    seqs.iter_mut().filter_map(|s| s.cache.host_mut()).collect();
                let logits = m.forward(&ids, &spans, &mut caches);
                for (cache, span) in caches.iter_mut().zip(&spans) {
                    cache.advance(span.len);
                }
                Logits::Host(logits)
            }
            Net::Device(m) => {
                let mut caches: Vec<&mut DeviceKvCache<B>> = seqs
                    .iter_mut()
                    .filter_map(|s| s.cache.device_mut())
                    .collect();
                let logits = m.forward(ids, &spans, &mut caches);
                for (cache, span) in caches.iter_mut().zip(&spans) {
                    cache.advance(span.len);
                }
                Logits::Device(logits)
            }
        })
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

impl<B: Backend> BurnLlama<B> {
    /// The forward pass with burn tensor operations; inputs already checked.
    fn forward(
        &self,
        ids: Vec<i32>,
        spans: &[SeqSpan],
        caches: &mut [&mut DeviceKvCache<B>],
    ) -> Tensor<B, 2> {
        let rows = ids.len();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows]), &self.device);
        let mut x = self
            .embed
            .clone()
            .select(0, ids)
            .cast(burn_tensor::DType::F32);
        if self.config.embed_scale != 1.0 {
            x = x.mul_scalar(self.config.embed_scale);
        }
        let post = |norm: &Option<RmsNorm<B>>, t: Tensor<B, 2>| match norm {
            Some(n) => n.forward(t),
            None => t,
        };
        let mut masks = StepMasks::new();
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = block.attn_norm.forward(x.clone());
            let (rope, window) = self.config.layer_rope(layer, &self.rope, &self.rope_local);
            let how = AttendWith {
                rope,
                scale: self.config.attn_scale,
                window,
            };
            let a = block
                .attn
                .forward(layer, h, spans, caches, &how, &mut masks);
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
/// 42 of the largest (at their temperature) are fewer; the others by them and the sum
/// of the rest ([`Head::rest`]) unless the draw lands in the rest. The device's top-k
/// is a kernel whose size is fixed at compile time, unrolled over the selection, so it
/// stays small.
pub const HEAD: usize = 64;

/// What a forward pass hands back of each row's logits ([`Llama::forward_fetch`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fetch<'a> {
    /// Each row's argmax: the device path downloads the ids alone, and leaves the logits
    /// on the device.
    Ids,
    /// The argmax, and each row's [`HEAD`] largest logits with their ids and the sum of
    /// the rest at the row's temperature, one a row (1 where the row does not draw at
    /// one) ([`StepLogits::heads`]); the device path leaves the logits on the device.
    Heads(&'a [f32]),
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
    /// The rest of the row, summed on the device at the temperature asked.
    pub rest: Rest,
    /// The rest of the row below the least in `top`, summed at temperature 1 (for
    /// log-probabilities; see [`crate::engine::sampler::logprobs_from_top`]).
    pub below_at_one: f32,
}

/// A step's logits, as [`Llama::forward_fetch`] hands them back.
#[derive(Debug)]
pub struct StepLogits<B: Backend> {
    /// `[sequences × vocab]`, row-major; empty where they were not downloaded, and only
    /// the rows [`StepLogits::fetch_rows`] downloaded where it did
    /// ([`StepLogits::rows_mut`] tells which).
    pub logits: Vec<f32>,
    /// Each row's largest logit's index (the lowest among equals), where found.
    pub argmax: Option<Vec<u32>>,
    /// Each row's head, where [`Fetch::Heads`] downloaded them.
    pub heads: Option<Vec<Head>>,
    /// The logits still on the device, for [`StepLogits::fetch_rows`].
    device: Option<Tensor<B, 2>>,
    /// The rows `logits` holds, where [`StepLogits::fetch_rows`] downloaded some of them
    /// (`None`: all, or none where `logits` is empty).
    held: Option<Vec<bool>>,
    /// Rows in the step: one a sequence.
    rows: usize,
    /// Rows of logits downloaded from the device so far.
    downloaded: usize,
}

impl<B: Backend> StepLogits<B> {
    /// Downloads the logits of the rows `wanted` marks, where they are still on the
    /// device (a draw its head did not decide, or one that the sampler's adjustments or a
    /// grammar change, needs its whole row); the others stay there. Once only.
    pub fn fetch_rows(&mut self, wanted: &[bool]) {
        let Some(t) = self.device.take().filter(|_| self.logits.is_empty()) else {
            return;
        };
        let [n, _] = t.dims();
        assert_eq!(wanted.len(), n, "a mark a row");
        let picked: Vec<i32> = (0..n as i32).filter(|&r| wanted[r as usize]).collect();
        self.downloaded += picked.len();
        if picked.len() == n {
            self.logits = to_host(t);
        } else if !picked.is_empty() {
            let device = t.device();
            let index = Tensor::<B, 1, Int>::from_ints(picked.as_slice(), &device);
            self.logits = to_host(t.select(0, index));
            self.held = Some(wanted.to_vec());
        }
    }

    /// Rows of logits downloaded from the device (none on the host engine, whose logits
    /// are host memory).
    pub fn downloaded_rows(&self) -> usize {
        self.downloaded
    }

    /// Each row's logits: the row where it was downloaded, empty where it was not.
    pub fn rows_mut(&mut self) -> Vec<&mut [f32]> {
        let n = self.rows;
        let held = self
            .held
            .as_ref()
            .map_or(n, |h| h.iter().filter(|&&w| w).count());
        if self.logits.is_empty() || held == 0 {
            return (0..n).map(|_| &mut [][..]).collect();
        }
        let vocab = self.logits.len() / held;
        let mut chunks = self.logits.chunks_exact_mut(vocab);
        match &self.held {
            None => chunks.collect(),
            Some(wanted) => wanted
                .iter()
                .map(|&w| {
                    if w {
                        chunks.next().expect("a downloaded row")
                    } else {
                        &mut [][..]
                    }
                })
                .collect(),
        }
    }
}

/// Each row's argmax, its [`HEAD`] largest logits and ids, and the rest of it
/// ([`Rest`]: the logits equal to the least of those counted, those below it summed at
/// the row's `temperatures`), found on the device (`logits` has more than [`HEAD`]
/// columns): one download of ids and counts (the row's non-finite logits among them)
/// and one of values and sums.
fn device_heads<B: Backend>(logits: Tensor<B, 2>, temperatures: &[f32]) -> (Vec<u32>, Vec<Head>) {
    let [n, vocab] = logits.dims();
    assert_eq!(temperatures.len(), n, "a temperature a row");
    let device = logits.device();
    let ids = logits.clone().argtopk(HEAD, 1);
    let values = logits.clone().gather(1, ids.clone());
    let least = values.clone().min_dim(1).expand([n, vocab]);
    let max = values.clone().max_dim(1).expand([n, vocab]);
    let inverse: Vec<f32> = temperatures.iter().map(|t| 1.0 / t).collect();
    let inverse = Tensor::<B, 1>::from_floats(inverse.as_slice(), &device)
        .reshape([n, 1])
        .expand([n, vocab]);
    let outside = logits.clone().greater_equal(least.clone());
    let shifted = logits.clone() - max;
    let below = (shifted.clone() * inverse)
        .exp()
        .mask_fill(outside.clone(), 0.0)
        .sum_dim(1);
    let below_at_one = shifted.exp().mask_fill(outside, 0.0).sum_dim(1);
    let ties = logits.clone().equal(least).int().sum_dim(1);
    let argmax = logits.clone().argmax(1);
    let odd = logits.is_finite().bool_not().int().sum_dim(1);
    let ints = Tensor::cat(vec![ids, odd, argmax, ties], 1)
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("head ids");
    let floats = to_host(Tensor::cat(vec![values, below, below_at_one], 1));
    let width = HEAD + 3;
    debug_assert_eq!(ints.len(), n * width);
    let argmax = ints
        .chunks_exact(width)
        .map(|r| r[HEAD + 1] as u32)
        .collect();
    let heads = ints
        .chunks_exact(width)
        .zip(floats.chunks_exact(HEAD + 2))
        .map(|(row, values)| Head {
            top: row[..HEAD]
                .iter()
                .zip(values)
                .map(|(&id, &v)| (id as u32, v))
                .collect(),
            finite: row[HEAD] == 0,
            rest: Rest {
                ties: row[HEAD + 2] as usize,
                below: values[HEAD],
            },
            below_at_one: values[HEAD + 1],
        })
        .collect();
    (argmax, heads)
}

/// Logits where a forward pass left them.
enum Logits<B: Backend> {
    /// `[sequences × vocab]`, row-major, from the host path, with each row's argmax.
    Host(HostLogits),
    /// `[sequences, vocab]` from the burn path.
    Device(Tensor<B, 2>),
}
