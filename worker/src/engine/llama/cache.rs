//! The per-sequence KV cache.
//!
//! A cache belongs to one sequence; the weights are shared by all sequences
//! (`forward(&self, …, &mut cache)`). Keys are stored after RoPE.
//!
//! Two stores, one per engine, as two types ([`HostKvCache`], [`DeviceKvCache`]) under
//! one [`KvCache`]:
//! - the device engine's: per layer one `[kv_heads, room, head_dim]` tensor each for keys
//!   and values, in [`KvDtype`], with room for the positions the sequence is expected to
//!   reach, written in place with `slice_assign`; nothing is concatenated or copied as
//!   the sequence grows;
//! - the host engine's ([`super::host`]): plain host vectors, to which a step appends its
//!   keys and values in place (they take room for the positions their sequence is
//!   expected to reach when they first grow, so a step copies nothing already cached),
//!   in [`KvDtype`]: f16 by default (half the memory, and half the bytes attention reads
//!   at every step), or f32.

use burn_tensor::{backend::Backend, DType, Tensor};
use half::f16;

use crate::engine::cpu::attention::KvValue;

/// How the host store keeps keys and values (`worker.kv_dtype`).
///
/// f16 is what llama.cpp and the GPU servers keep by default: each key and value is
/// rounded once, when stored, and widened exactly when read; every sum stays f32. On
/// the default model the logits then move by up to ~1.3e-2 from an f32 store, with the
/// same greedy tokens on the reference cases (`worker/tests/reference.rs`). The type is
/// part of the engine's fingerprint, the root of every stream's hash chain: a worker
/// keeping the other type refuses to resume a stream, as one with another weight format
/// does, since it would not continue the same text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// IEEE half precision: half the bytes of f32.
    #[default]
    F16,
    /// Single precision, as computed.
    F32,
}

impl KvDtype {
    /// The burn dtype of the device store's tensors.
    pub fn burn(self) -> DType {
        match self {
            KvDtype::F16 => DType::F16,
            KvDtype::F32 => DType::F32,
        }
    }

    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("unknown KV dtype {other:?} (expected f16 or f32)")),
        }
    }
}

/// An element type of the host store.
pub(crate) trait KvElem: KvValue {
    /// The layers of `store` when it holds this type.
    fn layers(store: &mut HostStore) -> Option<&mut Vec<HostKv<Self>>>;
    /// A packed span of this type as a prefix-cache block, and back.
    fn block(values: Box<[Self]>) -> KvBlock;
    fn unblock(block: &KvBlock) -> Option<&[Self]>;
}

impl KvElem for f32 {
    fn layers(store: &mut HostStore) -> Option<&mut Vec<HostKv<Self>>> {
        match store {
            HostStore::F32(l) => Some(l),
            HostStore::F16(_) => None,
        }
    }
    fn block(values: Box<[Self]>) -> KvBlock {
        KvBlock::F32(values)
    }
    fn unblock(block: &KvBlock) -> Option<&[Self]> {
        match block {
            KvBlock::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl KvElem for f16 {
    fn layers(store: &mut HostStore) -> Option<&mut Vec<HostKv<Self>>> {
        match store {
            HostStore::F16(l) => Some(l),
            HostStore::F32(_) => None,
        }
    }
    fn block(values: Box<[Self]>) -> KvBlock {
        KvBlock::F16(values)
    }
    fn unblock(block: &KvBlock) -> Option<&[Self]> {
        match block {
            KvBlock::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// Keys and values of consecutive positions of every layer, for the prefix cache: on
/// the host packed per layer, the keys then the values, position-major; on the device a
/// copy of each layer's span (`[kv_heads, n, head_dim]` keys and values, a
/// `Vec<LayerKv<B>>` of the engine's backend), which stays on the device.
#[derive(Debug, Clone)]
pub enum KvBlock {
    F32(Box<[f32]>),
    F16(Box<[f16]>),
    Device {
        layers: std::sync::Arc<dyn std::any::Any + Send + Sync>,
        bytes: usize,
    },
}

impl KvBlock {
    /// Bytes of the values.
    pub fn bytes(&self) -> usize {
        match self {
            KvBlock::F32(v) => std::mem::size_of_val(&**v),
            KvBlock::F16(v) => std::mem::size_of_val(&**v),
            KvBlock::Device { bytes, .. } => *bytes,
        }
    }
}

/// Every layer's host store, in one element type.
#[derive(Debug, Clone)]
pub(crate) enum HostStore {
    F32(Vec<HostKv<f32>>),
    F16(Vec<HostKv<f16>>),
}

/// Runs `$body` with `$l` bound to the store's layers, whatever their type.
macro_rules! each_store {
    ($store:expr, $l:ident => $body:expr) => {
        match $store {
            HostStore::F32($l) => $body,
            HostStore::F16($l) => $body,
        }
    };
}

/// Keys and values of one layer on the device: `[kv_heads, room, head_dim]` each, of
/// which the first `len` positions are written.
#[derive(Debug, Clone)]
pub(crate) struct LayerKv<B: Backend> {
    pub(crate) k: Tensor<B, 3>,
    pub(crate) v: Tensor<B, 3>,
}

impl<B: Backend> LayerKv<B> {
    /// Positions there is room for.
    pub(crate) fn room(&self) -> usize {
        self.k.dims()[1]
    }
}

/// Keys and values of one layer on the host: position-major, `[len, kv_heads·head_dim]`
/// each.
#[derive(Debug, Clone, Default)]
pub(crate) struct HostKv<E> {
    pub(crate) k: Vec<E>,
    pub(crate) v: Vec<E>,
}

impl<E: Clone + Default> HostKv<E> {
    /// Grows both to `len` elements. When that needs a larger allocation, it takes room
    /// for `expected` elements at once (at least `len`): a vector that doubled as it
    /// went would copy everything so far each time, and sequences that started together
    /// would all copy in the same step.
    pub(crate) fn grow(&mut self, len: usize, expected: usize) {
        for x in [&mut self.k, &mut self.v] {
            if x.capacity() < len {
                x.reserve_exact(expected.max(len) - x.len());
            }
            x.resize(len, E::default());
        }
    }
}

/// Keys and values of every layer for the positions a sequence has seen, in the store
/// of the engine that made the cache ([`super::Llama::new_cache`]): a forward pass takes
/// only caches of its own engine.
#[derive(Debug, Clone)]
pub enum KvCache<B: Backend> {
    /// Host vectors, for the host engine.
    Host(HostKvCache),
    /// Tensors on the device, for the device engine.
    Device(DeviceKvCache<B>),
}

/// Calls `$body` with `$c` bound to the cache's store, whichever engine's it is.
macro_rules! either {
    ($cache:expr, $c:ident => $body:expr) => {
        match $cache {
            KvCache::Host($c) => $body,
            KvCache::Device($c) => $body,
        }
    };
}

impl<B: Backend> KvCache<B> {
    /// The positions this sequence will reach at most (its prompt and its token limit,
    /// within the context): the store takes room for them the first time it grows,
    /// instead of doubling (and copying) as it fills. Only what is written is touched.
    pub fn expect_positions(&mut self, positions: usize) {
        either!(self, c => c.expected = positions)
    }

    /// Marks positions `from..` as generated tokens: with integer-input weights
    /// (`native-i16`) the host engine runs their rows on the integer kernels whether
    /// they run one a step or replayed together after a move, and the prompt's rows on
    /// the f32 kernels. Unset, a row is treated as generated when it is the only new row
    /// of a non-empty cache. The device engine's rows take one arithmetic.
    pub fn set_decode_from(&mut self, from: usize) {
        if let KvCache::Host(c) = self {
            c.decode_from = Some(from);
        }
    }

    /// Positions cached so far (the position the next token will take).
    pub fn len(&self) -> usize {
        either!(self, c => c.len)
    }

    /// True before the first forward.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type of the store.
    pub fn kv_dtype(&self) -> KvDtype {
        either!(self, c => c.kv_dtype())
    }

    /// How many times layer 0's device store was allocated: once for a sequence that
    /// stays within the positions it was expected to reach, however many steps it runs;
    /// 0 for a host cache.
    pub fn device_allocations(&self) -> usize {
        match self {
            KvCache::Host(_) => 0,
            KvCache::Device(c) => c.allocations,
        }
    }

    /// Where layer 0's host keys live and how many elements they have room for.
    #[cfg(test)]
    pub(crate) fn host_allocation(&self) -> (usize, usize) {
        match self {
            KvCache::Host(c) => {
                each_store!(&c.store, l => l.first().map_or((0, 0), |kv| (kv.k.as_ptr() as usize, kv.k.capacity())))
            }
            KvCache::Device(_) => (0, 0),
        }
    }

    /// The host store, for the host engine's forward pass.
    pub(crate) fn host_mut(&mut self) -> Option<&mut HostKvCache> {
        match self {
            KvCache::Host(c) => Some(c),
            KvCache::Device(_) => None,
        }
    }

    /// The device store, for the device engine's forward pass.
    pub(crate) fn device_mut(&mut self) -> Option<&mut DeviceKvCache<B>> {
        match self {
            KvCache::Device(c) => Some(c),
            KvCache::Host(_) => None,
        }
    }

    /// Whether the host engine made this cache.
    pub(crate) fn is_host(&self) -> bool {
        matches!(self, KvCache::Host(_))
    }

    /// Keys and values of positions `start..start + n` of every layer, for the prefix
    /// cache: packed from the host store (per layer, the keys then the values,
    /// position-major), or copied on the device from the device store. `None` when the
    /// positions are not cached.
    pub(crate) fn span(&self, start: usize, n: usize) -> Option<KvBlock> {
        if start + n > self.len() || n == 0 {
            return None;
        }
        either!(self, c => c.span(start, n))
    }

    /// Appends the first `take` of `n` positions made by [`KvCache::span`] to the store
    /// of every layer. Returns false, changing nothing, when the values do not fit this
    /// cache's shape or store (a block of the other engine, or of the other element
    /// type), `take` is 0 or over `n`.
    pub(crate) fn push_span(&mut self, n: usize, take: usize, block: &KvBlock) -> bool {
        if take == 0 || take > n {
            return false;
        }
        let done = either!(self, c => c.push_span(n, take, block));
        if done {
            either!(self, c => c.len += take);
        }
        done
    }

    /// Forgets everything after the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len() {
            either!(self, c => c.truncate(len));
        }
    }

    /// Bytes held, for KV budgets: the device store's whole room (allocated up front),
    /// and the host store's cached positions (its room for the positions still expected
    /// is not counted: it is not touched until they are written).
    pub fn bytes(&self) -> usize {
        either!(self, c => c.bytes())
    }
}

/// The host engine's store: every layer's keys and values as host vectors, in one
/// element type, to which a step appends in place.
#[derive(Debug, Clone)]
pub struct HostKvCache {
    store: HostStore,
    len: usize,
    decode_from: Option<usize>,
    /// Positions the sequence is expected to reach ([`KvCache::expect_positions`]).
    expected: usize,
}

impl HostKvCache {
    /// An empty store for `n_layers` layers, in `dtype`.
    pub(crate) fn new(n_layers: usize, dtype: KvDtype) -> Self {
        Self {
            store: match dtype {
                KvDtype::F16 => HostStore::F16(vec![HostKv::default(); n_layers]),
                KvDtype::F32 => HostStore::F32(vec![HostKv::default(); n_layers]),
            },
            len: 0,
            decode_from: None,
            expected: 0,
        }
    }

    /// See [`KvCache::expect_positions`].
    pub(crate) fn expected_positions(&self) -> usize {
        self.expected
    }

    /// Whether the row at `pos`, one of `rows` new rows, is a generated token's (see
    /// [`KvCache::set_decode_from`]).
    pub(crate) fn is_decode_row(&self, pos: usize, rows: usize) -> bool {
        match self.decode_from {
            Some(from) => pos >= from,
            None => rows == 1 && pos > 0,
        }
    }

    /// Every layer's store (the forward pass appends to it), when it holds `E`.
    pub(crate) fn layers<E: KvElem>(&mut self) -> Option<&mut [HostKv<E>]> {
        E::layers(&mut self.store).map(|l| l.as_mut_slice())
    }

    /// The element type of the store.
    pub(crate) fn kv_dtype(&self) -> KvDtype {
        match self.store {
            HostStore::F32(_) => KvDtype::F32,
            HostStore::F16(_) => KvDtype::F16,
        }
    }

    /// Records that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn span(&self, start: usize, n: usize) -> Option<KvBlock> {
        fn pack<E: KvElem>(
            host: &[HostKv<E>],
            len: usize,
            start: usize,
            n: usize,
        ) -> Option<KvBlock> {
            let width = host.first()?.k.len() / len;
            let mut out = Vec::with_capacity(host.len() * 2 * n * width);
            for kv in host {
                out.extend_from_slice(&kv.k[start * width..(start + n) * width]);
                out.extend_from_slice(&kv.v[start * width..(start + n) * width]);
            }
            Some(E::block(out.into_boxed_slice()))
        }
        each_store!(&self.store, l => pack(l, self.len, start, n))
    }

    /// [`KvCache::push_span`] once `take` is checked; leaves the length to the caller.
    fn push_span(&mut self, n: usize, take: usize, block: &KvBlock) -> bool {
        fn push<E: KvElem>(
            host: &mut [HostKv<E>],
            len: usize,
            expected: usize,
            n: usize,
            take: usize,
            block: &KvBlock,
        ) -> bool {
            let layers = host.len();
            let Some(kv) = E::unblock(block) else {
                return false;
            };
            if layers == 0 || !kv.len().is_multiple_of(layers * 2 * n) {
                return false;
            }
            let width = kv.len() / (layers * 2 * n);
            if len > 0 && host[0].k.len() != len * width {
                return false;
            }
            for (layer, chunk) in host.iter_mut().zip(kv.chunks_exact(2 * n * width)) {
                let (k, v) = chunk.split_at(n * width);
                layer.grow((len + take) * width, expected * width);
                layer.k[len * width..].copy_from_slice(&k[..take * width]);
                layer.v[len * width..].copy_from_slice(&v[..take * width]);
            }
            true
        }
        let (len, expected) = (self.len, self.expected);
        each_store!(&mut self.store, l => push(l, len, expected, n, take, block))
    }

    fn truncate(&mut self, len: usize) {
        let old = self.len;
        each_store!(&mut self.store, l => {
            for kv in l.iter_mut() {
                let keep = if kv.k.is_empty() { 0 } else { kv.k.len() / old * len };
                kv.k.truncate(keep);
                kv.v.truncate(keep);
            }
        });
        self.len = len;
    }

    fn bytes(&self) -> usize {
        let values: usize =
            each_store!(&self.store, l => l.iter().map(|kv| kv.k.len() + kv.v.len()).sum());
        values * self.kv_dtype().bytes()
    }
}

/// The device engine's store: per layer one `[kv_heads, room, head_dim]` tensor each
/// for keys and values, written in place.
#[derive(Debug, Clone)]
pub struct DeviceKvCache<B: Backend> {
    layers: Vec<Option<LayerKv<B>>>,
    dtype: KvDtype,
    len: usize,
    /// Positions the sequence is expected to reach ([`KvCache::expect_positions`]).
    expected: usize,
    /// How many times layer 0's store was allocated ([`KvCache::device_allocations`]).
    allocations: usize,
}

impl<B: Backend> DeviceKvCache<B> {
    /// An empty store for `n_layers` layers, in `dtype`; nothing is allocated until the
    /// first write.
    pub(crate) fn new(n_layers: usize, dtype: KvDtype) -> Self {
        Self {
            layers: vec![None; n_layers],
            dtype,
            len: 0,
            expected: 0,
            allocations: 0,
        }
    }

    /// Records that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn kv_dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Writes `k`, `v` (`[kv_heads, new, head_dim]`, positions `len..len + new`) into
    /// `layer`'s store and returns the store, whose first `len + new` positions are then
    /// written. The store is allocated once with room for the expected positions (or
    /// what is needed), and only when a sequence outruns it again, doubling; the write
    /// is in place while nothing else holds the store.
    pub(crate) fn append(&mut self, layer: usize, k: Tensor<B, 3>, v: Tensor<B, 3>) -> LayerKv<B> {
        let [kvh, new, d] = k.dims();
        let (start, end) = (self.len, self.len + new);
        let dtype = self.dtype.burn();
        let slot = &mut self.layers[layer];
        let mut kv = match slot.take() {
            Some(kv) if kv.room() >= end => kv,
            prev => {
                let room = end
                    .max(self.expected)
                    .max(prev.as_ref().map_or(0, |p| 2 * p.room()));
                let device = k.device();
                let zeros = || Tensor::<B, 3>::zeros([kvh, room, d], (&device, dtype));
                let mut fresh = LayerKv {
                    k: zeros(),
                    v: zeros(),
                };
                if let Some(p) = prev.filter(|_| start > 0) {
                    fresh.k = fresh
                        .k
                        .slice_assign([0..kvh, 0..start, 0..d], p.k.narrow(1, 0, start));
                    fresh.v = fresh
                        .v
                        .slice_assign([0..kvh, 0..start, 0..d], p.v.narrow(1, 0, start));
                }
                if layer == 0 {
                    self.allocations += 1;
                }
                fresh
            }
        };
        kv.k = kv.k.slice_assign([0..kvh, start..end, 0..d], k.cast(dtype));
        kv.v = kv.v.slice_assign([0..kvh, start..end, 0..d], v.cast(dtype));
        *slot = Some(kv.clone());
        kv
    }

    fn span(&self, start: usize, n: usize) -> Option<KvBlock> {
        // A copy, not a view: a view would hold the sequence's whole store.
        let copy = |t: &Tensor<B, 3>| {
            let [kvh, _, d] = t.dims();
            Tensor::<B, 3>::zeros([kvh, n, d], (&t.device(), t.dtype()))
                .slice_assign([0..kvh, 0..n, 0..d], t.clone().narrow(1, start, n))
        };
        let layers: Vec<LayerKv<B>> = self
            .layers
            .iter()
            .map(|kv| {
                kv.as_ref().map(|kv| LayerKv {
                    k: copy(&kv.k),
                    v: copy(&kv.v),
                })
            })
            .collect::<Option<_>>()?;
        let bytes = layers
            .iter()
            .map(|kv| 2 * kv.k.shape().num_elements())
            .sum::<usize>()
            * self.dtype.bytes();
        Some(KvBlock::Device {
            layers: std::sync::Arc::new(layers),
            bytes,
        })
    }

    /// [`KvCache::push_span`] once `take` is checked; leaves the length to the caller.
    fn push_span(&mut self, n: usize, take: usize, block: &KvBlock) -> bool {
        let KvBlock::Device { layers, .. } = block else {
            return false;
        };
        let Some(layers) = layers.downcast_ref::<Vec<LayerKv<B>>>() else {
            return false;
        };
        let dtype = self.dtype.burn();
        let fits = layers.len() == self.layers.len()
            && layers
                .iter()
                .all(|kv| kv.room() == n && kv.k.dtype() == dtype);
        if !fits {
            return false;
        }
        for (layer, kv) in layers.iter().enumerate() {
            self.append(
                layer,
                kv.k.clone().narrow(1, 0, take),
                kv.v.clone().narrow(1, 0, take),
            );
        }
        true
    }

    fn truncate(&mut self, len: usize) {
        // The store keeps its room: positions past `len` are written over.
        if len == 0 {
            self.layers.iter_mut().for_each(|slot| *slot = None);
        }
        self.len = len;
    }

    fn bytes(&self) -> usize {
        let values: usize = self
            .layers
            .iter()
            .flatten()
            .map(|kv| kv.k.shape().num_elements() + kv.v.shape().num_elements())
            .sum();
        values * self.dtype.bytes()
    }
}
