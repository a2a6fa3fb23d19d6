//! Parsing GGUF v2/v3 files: header, metadata, tensor table, data section.
//!
//! The file is memory-mapped and parsed once in [`GgufFile::open`]. Every count, length,
//! dimension and offset read from the file is checked against the bytes that are actually
//! there before anything is allocated or sliced, so a damaged or hostile file yields a
//! [`GgufError`], never a panic or a huge allocation.
//!
//! Layout (all little-endian):
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type: u32, value)
//! tensor_count × (name: string, n_dims: u32, dims: n_dims × u64, type: u32, offset: u64)
//! padding to `general.alignment` (default 32) | tensor data
//! ```
//! where a string is a u64 byte length followed by UTF-8 bytes, and an array value is
//! `elem_type: u32, len: u64, len × value`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use super::dequant::GgmlType;

/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// Deepest nesting of arrays inside arrays accepted in metadata. Real files nest at most
/// once; the bound keeps a hostile file from exhausting the stack through recursion.
const MAX_ARRAY_DEPTH: usize = 8;

/// Most metadata values (array elements included) a file may hold. Each value takes
/// 32 bytes in memory but can take 1 byte in the file; the bound caps that blow-up at
/// 512 MiB. Real files hold a few hundred thousand (vocabulary, merges, token types).
const MAX_META_VALUES: u64 = 1 << 24;

const MAGIC: &[u8; 4] = b"GGUF";

/// Everything that can go wrong reading (or writing) a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot open GGUF file {}: {source}", path.display())]
    Open {
        /// The file that was asked for.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// An I/O error while writing.
    #[error("GGUF I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The file does not start with the bytes `GGUF`.
    #[error("not a GGUF file: it starts with {magic:02x?}, expected \"GGUF\"")]
    NotGguf {
        /// The first four bytes of the file.
        magic: [u8; 4],
    },
    /// A GGUF version other than 2 or 3 (version 1 used 32-bit counts; a big-endian file
    /// shows up here too, as a byte-swapped version number).
    #[error("unsupported GGUF version {0} (supported: 2 and 3, little-endian)")]
    UnsupportedVersion(u32),
    /// The file ends before something it announces.
    #[error("GGUF file truncated: {what} at byte {offset} runs past the end of the file")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts in the file.
        offset: u64,
    },
    /// A count, length or size that is out of range.
    #[error("GGUF value out of range: {what}")]
    TooLarge {
        /// What is too large, with its value.
        what: String,
    },
    /// A key or tensor name that is not UTF-8.
    #[error("GGUF {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
    },
    /// A metadata value type id that GGUF does not define.
    #[error("metadata `{key}` has unknown value type {type_id}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// The same metadata key appears twice.
    #[error("metadata key `{0}` appears more than once")]
    DuplicateKey(String),
    /// Two tensors share a name.
    #[error("tensor `{0}` appears more than once")]
    DuplicateTensor(String),
    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment is {0}; it must be a power of two")]
    BadAlignment(u64),
    /// A tensor's data offset is not a multiple of the alignment.
    #[error(
        "tensor `{name}` has data offset {offset}, not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        /// The tensor.
        name: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's shape is invalid for its type, or data does not match a shape.
    #[error("tensor `{name}` has a bad shape: {reason}")]
    BadShape {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's data lies (partly) beyond the end of the file.
    #[error(
        "tensor `{name}` data ({n_bytes} bytes at byte {offset}) lies beyond the end of \
         the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        /// The tensor.
        name: String,
        /// Absolute offset of its data.
        offset: u64,
        /// Size of its data.
        n_bytes: u64,
        /// Length of the file.
        file_len: u64,
    },
    /// A tensor type this code cannot size, dequantize or quantize.
    #[error("tensor `{name}` has type {type_name} (id {type_id}), which is not supported here")]
    UnsupportedType {
        /// The tensor.
        name: String,
        /// The ggml type id.
        type_id: u32,
        /// The type's name, `unknown` if GGUF does not define it.
        type_name: &'static str,
    },
    /// A required metadata key is absent.
    #[error("metadata key `{0}` is missing")]
    MissingKey(String),
    /// A metadata value has another type than the one asked for.
    #[error("metadata key `{key}` has the wrong type: expected {expected}")]
    WrongType {
        /// The metadata key.
        key: String,
        /// What was asked for.
        expected: &'static str,
    },
    /// No tensor of that name.
    #[error("tensor `{0}` not found")]
    MissingTensor(String),
}

impl GgufError {
    /// A stable identifier of the error kind, for logs, metrics and response bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            GgufError::Open { .. } => "open",
            GgufError::Io(_) => "io",
            GgufError::NotGguf { .. } => "not_gguf",
            GgufError::UnsupportedVersion(_) => "unsupported_version",
            GgufError::Truncated { .. } => "truncated",
            GgufError::TooLarge { .. } => "too_large",
            GgufError::InvalidUtf8 { .. } => "invalid_utf8",
            GgufError::UnknownValueType { .. } => "unknown_value_type",
            GgufError::DuplicateKey(_) => "duplicate_key",
            GgufError::DuplicateTensor(_) => "duplicate_tensor",
            GgufError::BadAlignment(_) => "bad_alignment",
            GgufError::MisalignedTensor { .. } => "misaligned_tensor",
            GgufError::BadShape { .. } => "bad_shape",
            GgufError::TensorOutOfBounds { .. } => "tensor_out_of_bounds",
            GgufError::UnsupportedType { .. } => "unsupported_type",
            GgufError::MissingKey(_) => "missing_key",
            GgufError::WrongType { .. } => "wrong_type",
            GgufError::MissingTensor(_) => "missing_tensor",
        }
    }

    pub(crate) fn unsupported(name: &str, ty: GgmlType) -> Self {
        GgufError::UnsupportedType {
            name: name.to_owned(),
            type_id: ty.id(),
            type_name: ty.name(),
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// GGUF type 0.
    U8(u8),
    /// GGUF type 1.
    I8(i8),
    /// GGUF type 2.
    U16(u16),
    /// GGUF type 3.
    I16(i16),
    /// GGUF type 4.
    U32(u32),
    /// GGUF type 5.
    I32(i32),
    /// GGUF type 10.
    U64(u64),
    /// GGUF type 11.
    I64(i64),
    /// GGUF type 6.
    F32(f32),
    /// GGUF type 12.
    F64(f64),
    /// GGUF type 7.
    Bool(bool),
    /// GGUF type 8. Invalid UTF-8 in a value is replaced by U+FFFD.
    String(String),
    /// GGUF type 9; all elements share one type (arrays may nest).
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Floats, and integers converted to `f64` (exactly below 2^53).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of this value's type (`u32`, `string`, `array`...).
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// The GGUF value type id of this value (the `gguf_type` enum).
    pub fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::String(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }
}

/// Where a tensor is and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: fastest-varying first (the reverse of a row-major shape).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
    /// Number of elements (product of `dims`).
    pub n_elements: u64,
}

/// The bytes of a file: mapped, or owned (files parsed from memory, e.g. by a fuzzer).
enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An open, validated GGUF file, usually memory-mapped.
pub struct GgufFile {
    /// The file's bytes; tensor data is read from them without copying.
    mmap: Backing,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    tensors: Vec<TensorInfo>,
    /// Name → index into `tensors`.
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("len", &self.mmap.len())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Map and parse the file at `path`, validating every tensor against the file size.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let open_err = |source| GgufError::Open {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        let len = file.metadata().map_err(open_err)?.len();
        if len < 4 {
            return Err(GgufError::Truncated {
                what: "magic".into(),
                offset: 0,
            });
        }
        // SAFETY: the map is read-only. As with any file mapping, another process that
        // truncates or rewrites the file while it is mapped breaks the bytes we see (or
        // raises SIGBUS); model files are not modified while a worker serves them.
        let mmap = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        Self::from_backing(Backing::Map(mmap))
    }

    /// Parse a GGUF image held in memory. Tensor data is then only as aligned as the
    /// vector's allocation; [`GgufFile::open`] is the way to load a model.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(mmap: Backing) -> Result<Self, GgufError> {
        let parsed = parse(&mmap)?;
        Ok(GgufFile {
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            by_name: parsed.by_name,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data-section alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a MetaValue) -> Option<T>,
    ) -> Result<T, GgufError> {
        let value = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))?;
        convert(value).ok_or_else(|| GgufError::WrongType {
            key: key.to_owned(),
            expected,
        })
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.require(key, "non-negative integer", MetaValue::as_u64)
    }

    /// A float or integer.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.require(key, "number", MetaValue::as_f64)
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.require(key, "string", MetaValue::as_str)
    }

    /// A boolean.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.require(key, "bool", MetaValue::as_bool)
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.require(key, "array of strings", |v| {
            v.as_array()?.iter().map(MetaValue::as_str).collect()
        })
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor of this file (empty for a `TensorInfo` that does not
    /// describe this file's bytes).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let range = usize::try_from(info.offset).ok().and_then(|start| {
            let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
            Some(start..end)
        });
        range.and_then(|r| self.mmap.get(r)).unwrap_or(&[])
    }

    /// A tensor's values as f32, in ggml order.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        self.dequantize_tensor(info)
    }

    /// Like [`GgufFile::dequantize`], for a tensor already looked up.
    pub fn dequantize_tensor(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        if !info.ggml_type.dequant_supported() {
            return Err(GgufError::unsupported(&info.name, info.ggml_type));
        }
        let n = usize::try_from(info.n_elements).map_err(|_| GgufError::TooLarge {
            what: format!("tensor `{}` has {} elements", info.name, info.n_elements),
        })?;
        super::dequant::dequantize(info.ggml_type, self.tensor_bytes(info), n).map_err(
            |e| match e {
                GgufError::UnsupportedType {
                    type_id, type_name, ..
                } => GgufError::UnsupportedType {
                    name: info.name.clone(),
                    type_id,
                    type_name,
                },
                GgufError::BadShape { reason, .. } => GgufError::BadShape {
                    name: info.name.clone(),
                    reason,
                },
                other => other,
            },
        )
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }
}

/// What [`parse`] finds in a file.
struct Parsed {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

/// Parse and validate a whole GGUF image.
fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut cur = Cursor { buf, pos: 0 };
    let magic = cur.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(GgufError::NotGguf { magic });
    }
    let version = cur.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = cur.u64("tensor count")?;
    let n_kv = cur.u64("metadata count")?;

    // A key/value pair takes at least 13 bytes (empty key, type, one-byte value).
    cur.check_count(n_kv, 13, "metadata count")?;
    let mut metadata = BTreeMap::new();
    let mut budget = MAX_META_VALUES;
    for i in 0..n_kv {
        let key = cur.name(|| format!("metadata key #{i}"))?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        let type_id = cur.u32("metadata value type")?;
        let value = cur
            .value(type_id, &key, 0, &mut budget)
            .map_err(|e| match e {
                GgufError::Truncated { what, offset } => GgufError::Truncated {
                    what: format!("{what} of metadata `{key}`"),
                    offset,
                },
                other => other,
            })?;
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or_else(|| GgufError::WrongType {
                key: "general.alignment".into(),
                expected: "u32",
            })?;
            if !a.is_power_of_two() || a > 1 << 30 {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };

    // A tensor info takes at least 24 bytes (empty name, n_dims, type, offset).
    cur.check_count(n_tensors, 24, "tensor count")?;
    let mut raw = Vec::with_capacity(usize::try_from(n_tensors).unwrap_or(0));
    for i in 0..n_tensors {
        raw.push(cur.tensor_info(i)?);
    }

    let file_len = buf.len() as u64;
    let data_offset = align_up(cur.pos as u64, alignment).ok_or_else(|| GgufError::TooLarge {
        what: "data section offset".into(),
    })?;
    let mut tensors = Vec::with_capacity(raw.len());
    let mut by_name = HashMap::with_capacity(raw.len());
    for (name, dims, ggml_type, rel) in raw {
        if by_name.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor(name));
        }
        let info = check_tensor(name, dims, ggml_type, rel, alignment, data_offset, file_len)?;
        tensors.push(info);
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
        by_name,
        alignment,
        data_offset,
    })
}

/// `x` rounded up to a multiple of `align` (a power of two).
fn align_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? & !(align - 1))
}

/// Size and bounds checks of one tensor.
fn check_tensor(
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    rel_offset: u64,
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<TensorInfo, GgufError> {
    let (Some(block), Some(_)) = (ggml_type.block_size(), ggml_type.block_bytes()) else {
        return Err(GgufError::unsupported(&name, ggml_type));
    };
    let mut n_elements: u64 = 1;
    for &d in &dims {
        n_elements = match n_elements.checked_mul(d) {
            Some(n) if n <= i64::MAX as u64 => n,
            _ => {
                return Err(GgufError::TooLarge {
                    what: format!("tensor `{name}` dimensions {dims:?}"),
                })
            }
        };
    }
    let first = dims.first().copied().unwrap_or(1);
    if first % block as u64 != 0 {
        return Err(GgufError::BadShape {
            reason: format!(
                "first dimension {first} is not a multiple of the {} block size {block}",
                ggml_type.name()
            ),
            name,
        });
    }
    let n_bytes = ggml_type
        .bytes_for(n_elements)
        .ok_or_else(|| GgufError::TooLarge {
            what: format!("tensor `{name}` size"),
        })?;
    if !rel_offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedTensor {
            name,
            offset: rel_offset,
            alignment,
        });
    }
    let offset = data_offset.checked_add(rel_offset);
    let end = offset.and_then(|o| o.checked_add(n_bytes));
    match (offset, end) {
        (Some(offset), Some(end)) if end <= file_len => Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
            n_elements,
        }),
        _ => Err(GgufError::TensorOutOfBounds {
            name,
            offset: data_offset.saturating_add(rel_offset),
            n_bytes,
            file_len,
        }),
    }
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        let slice = usize::try_from(n)
            .ok()
            .and_then(|n| Some(self.pos..self.pos.checked_add(n)?))
            .and_then(|r| self.buf.get(r));
        match slice {
            Some(s) => {
                self.pos += s.len();
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, || what.to_owned())?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Fail unless `count` items of at least `min_size` bytes each can fit in the rest of
    /// the file. Called before any allocation sized by `count`.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<(), GgufError> {
        if count > self.remaining() as u64 / min_size {
            return Err(GgufError::TooLarge {
                what: format!(
                    "{what} {count} (only {} bytes remain at byte {})",
                    self.remaining(),
                    self.pos
                ),
            });
        }
        Ok(())
    }

    fn raw_string(&mut self, what: impl Fn() -> String) -> Result<&'a [u8], GgufError> {
        let len = self
            .u64("string length")
            .map_err(|_| GgufError::Truncated {
                what: format!("length of {}", what()),
                offset: self.pos as u64,
            })?;
        self.take(len, || format!("{} ({len} bytes)", what()))
    }

    /// A key or tensor name: must be UTF-8.
    fn name(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let bytes = self.raw_string(&what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { what: what() }),
        }
    }

    /// One metadata value of type `type_id`.
    fn value(
        &mut self,
        type_id: u32,
        key: &str,
        depth: usize,
        budget: &mut u64,
    ) -> Result<MetaValue, GgufError> {
        *budget = budget.checked_sub(1).ok_or_else(|| GgufError::TooLarge {
            what: format!("more than {MAX_META_VALUES} metadata values"),
        })?;
        Ok(match type_id {
            0 => MetaValue::U8(u8::from_le_bytes(self.array("u8")?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array("i8")?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array("u32")?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => MetaValue::Bool(self.array::<1>("bool")?[0] != 0),
            8 => {
                let bytes = self.raw_string(|| "string".to_owned())?;
                // Lossy: some converters store token pieces that are partial UTF-8
                // sequences; refusing the whole model over one token helps nobody.
                MetaValue::String(String::from_utf8_lossy(bytes).into_owned())
            }
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooLarge {
                        what: format!("arrays nested more than {MAX_ARRAY_DEPTH} deep in `{key}`"),
                    });
                }
                let elem_type = self.u32("array element type")?;
                let len = self.u64("array length")?;
                let min_size = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => {
                        return Err(GgufError::UnknownValueType {
                            key: key.to_owned(),
                            type_id: elem_type,
                        })
                    }
                };
                self.check_count(len, min_size, &format!("array length of `{key}`"))?;
                if len > *budget {
                    return Err(GgufError::TooLarge {
                        what: format!("more than {MAX_META_VALUES} metadata values"),
                    });
                }
                let mut items = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
                for _ in 0..len {
                    items.push(self.value(elem_type, key, depth + 1, budget)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array("u64")?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array("f64")?)),
            other => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_owned(),
                    type_id: other,
                })
            }
        })
    }

    /// One tensor-info record: (name, dims, type, offset relative to the data section).
    fn tensor_info(&mut self, index: u64) -> Result<(String, Vec<u64>, GgmlType, u64), GgufError> {
        let name = self.name(|| format!("name of tensor #{index}"))?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadShape {
                name,
                reason: format!("{n_dims} dimensions (at most {MAX_DIMS})"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let ggml_type = GgmlType::from_id(self.u32("tensor type")?);
        let offset = self.u64("tensor offset")?;
        Ok((name, dims, ggml_type, offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for id in 0..64 {
            assert_eq!(GgmlType::from_id(id).id(), id);
        }
        assert_eq!(GgmlType::from_id(3), GgmlType::Q4_1);
        assert_eq!(GgmlType::from_id(12), GgmlType::Q4K);
        assert_eq!(GgmlType::from_id(30), GgmlType::BF16);
        assert_eq!(GgmlType::from_id(4), GgmlType::Other(4));
        assert_eq!(GgmlType::Q6K.block_bytes(), Some(210));
        assert_eq!(GgmlType::Q4_1.bytes_for(576), Some(360));
        assert_eq!(GgmlType::Q4_1.bytes_for(20), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }

    #[test]
    fn meta_value_conversions() {
        assert_eq!(MetaValue::I32(-1).as_u64(), None);
        assert_eq!(MetaValue::I8(5).as_u64(), Some(5));
        assert_eq!(MetaValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetaValue::U16(7).as_f64(), Some(7.0));
        assert_eq!(MetaValue::F32(0.5).as_u64(), None);
        assert_eq!(MetaValue::Bool(true).as_u64(), None);
        assert_eq!(MetaValue::String("x".into()).as_str(), Some("x"));
    }

    #[test]
    fn parse_rejects_short_and_bad_headers() {
        assert_eq!(parse(b"GG").err().map(|e| e.kind()), Some("truncated"));
        assert_eq!(
            parse(b"GGML\x03\0\0\0").err().map(|e| e.kind()),
            Some("not_gguf")
        );
        let v1 = b"GGUF\x01\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
        assert!(matches!(parse(v1), Err(GgufError::UnsupportedVersion(1))));
    }

    #[test]
    fn empty_v3_file_parses() {
        let mut b = b"GGUF\x03\0\0\0".to_vec();
        b.extend(0u64.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        let p = parse(&b).expect("empty file is valid");
        assert!(p.tensors.is_empty() && p.metadata.is_empty());
        assert_eq!(p.data_offset, 32);
    }
}
