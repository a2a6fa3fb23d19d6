//! Writing GGUF v3 files, and ggml's reference quantizers.
//!
//! Used to generate tiny test models and random-weight benchmark models. Tensors are
//! quantized when added, so only the (smaller) quantized bytes are held until
//! [`GgufWriter::write_to`] streams everything out. The quantizers follow ggml's
//! `quantize_row_*_ref` (ggml-quants.c), so their output is byte-identical to ggml's and to
//! the `gguf` Python package's.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::f16;
use rayon::prelude::*;

use super::dequant::IQ4_VALUES;
use super::reader::{GgmlType, GgufError, MetaValue, DEFAULT_ALIGNMENT, MAX_DIMS};

/// Values per parallel task when quantizing.
const CHUNK_ELEMENTS: usize = 1 << 15;

/// A tensor waiting to be written.
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF v3 file: metadata in insertion order, tensors in insertion order, data
/// aligned to 32 bytes.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a metadata key. Keys must be unique; arrays must not mix element types;
    /// `general.alignment`, if given, must be 32 (the alignment this writer uses).
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: MetaValue,
    ) -> Result<(), GgufError> {
        let key = key.into();
        if key == "general.alignment" && value.as_u64() != Some(DEFAULT_ALIGNMENT) {
            return Err(GgufError::BadAlignment(value.as_u64().unwrap_or(0)));
        }
        check_array(&key, &value)?;
        if !self.keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        self.metadata.push((key, value));
        Ok(())
    }

    /// Add a tensor from f32 values in ggml order, quantizing it to `ty` now.
    ///
    /// `dims` are in ggml order (fastest-varying first); `data.len()` must be their
    /// product, and the first dimension a multiple of the type's block size. `ty` is one
    /// of those [`quantize`] supports.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: &[f32],
    ) -> Result<(), GgufError> {
        let name = name.into();
        let n = self.check_tensor(&name, dims, ty)?;
        if n != data.len() as u64 {
            return Err(GgufError::BadShape {
                name,
                reason: format!("dims {dims:?} hold {n} values, got {}", data.len()),
            });
        }
        let bytes = quantize(ty, data).map_err(|e| rename(e, &name))?;
        self.push(name, dims, ty, bytes);
        Ok(())
    }

    /// Add a tensor from raw bytes already in type `ty` (any type whose size is known).
    pub fn add_tensor_bytes(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        bytes: Vec<u8>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let n = self.check_tensor(&name, dims, ty)?;
        let want = ty.bytes_for(n);
        if want != Some(bytes.len() as u64) {
            return Err(GgufError::BadShape {
                name,
                reason: format!(
                    "{n} {} values need {want:?} bytes, got {}",
                    ty.name(),
                    bytes.len()
                ),
            });
        }
        self.push(name, dims, ty, bytes);
        Ok(())
    }

    /// Validate name, dims and type; returns the number of elements.
    fn check_tensor(&self, name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
        if self.names.contains(name) {
            return Err(GgufError::DuplicateTensor(name.to_owned()));
        }
        let bad = |reason: String| GgufError::BadShape {
            name: name.to_owned(),
            reason,
        };
        if dims.len() > MAX_DIMS {
            return Err(bad(format!(
                "{} dimensions (at most {MAX_DIMS})",
                dims.len()
            )));
        }
        let block = ty
            .block_size()
            .ok_or_else(|| GgufError::unsupported(name, ty))?;
        if dims.first().copied().unwrap_or(1) % block as u64 != 0 {
            return Err(bad(format!(
                "first dimension of {dims:?} is not a multiple of the {} block size {block}",
                ty.name()
            )));
        }
        dims.iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("dims {dims:?} overflow")))
    }

    fn push(&mut self, name: String, dims: &[u64], ggml_type: GgmlType, data: Vec<u8>) {
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
    }

    /// Write the file to `path` (created or truncated).
    pub fn write_to(&self, path: &Path) -> Result<(), GgufError> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        self.write(&mut out)?;
        out.flush()?;
        Ok(())
    }

    /// Write the file to any byte sink.
    pub fn write(&self, out: &mut impl Write) -> Result<(), GgufError> {
        let mut w = Counting { out, written: 0 };
        w.put(b"GGUF")?;
        w.put(&3u32.to_le_bytes())?;
        w.put(&(self.tensors.len() as u64).to_le_bytes())?;
        w.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            w.string(key)?;
            w.put(&value.type_id().to_le_bytes())?;
            w.value(value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            w.string(&t.name)?;
            w.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.put(&d.to_le_bytes())?;
            }
            w.put(&t.ggml_type.id().to_le_bytes())?;
            w.put(&offset.to_le_bytes())?;
            offset += padded(t.data.len() as u64);
        }
        w.pad()?;
        for t in &self.tensors {
            w.put(&t.data)?;
            w.pad()?;
        }
        w.out.flush()?;
        Ok(())
    }
}

/// `n` rounded up to the alignment.
fn padded(n: u64) -> u64 {
    n.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
}

/// Put the tensor's name into an error raised without one.
fn rename(e: GgufError, name: &str) -> GgufError {
    match e {
        GgufError::UnsupportedType {
            type_id, type_name, ..
        } => GgufError::UnsupportedType {
            name: name.to_owned(),
            type_id,
            type_name,
        },
        other => other,
    }
}

/// GGUF arrays hold one element type; nested arrays are checked recursively.
fn check_array(key: &str, value: &MetaValue) -> Result<(), GgufError> {
    if let MetaValue::Array(items) = value {
        if let Some(first) = items.first() {
            if items.iter().any(|v| v.type_id() != first.type_id()) {
                return Err(GgufError::WrongType {
                    key: key.to_owned(),
                    expected: "an array of one element type",
                });
            }
        }
        for item in items {
            check_array(key, item)?;
        }
    }
    Ok(())
}

/// A writer that counts bytes, for padding.
struct Counting<'a, W: Write> {
    out: &'a mut W,
    written: u64,
}

impl<W: Write> Counting<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let n = padded(self.written) - self.written;
        self.put(&[0u8; DEFAULT_ALIGNMENT as usize][..n as usize])
    }

    fn string(&mut self, s: &str) -> std::io::Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn value(&mut self, v: &MetaValue) -> std::io::Result<()> {
        match v {
            MetaValue::U8(x) => self.put(&x.to_le_bytes()),
            MetaValue::I8(x) => self.put(&x.to_le_bytes()),
            MetaValue::U16(x) => self.put(&x.to_le_bytes()),
            MetaValue::I16(x) => self.put(&x.to_le_bytes()),
            MetaValue::U32(x) => self.put(&x.to_le_bytes()),
            MetaValue::I32(x) => self.put(&x.to_le_bytes()),
            MetaValue::U64(x) => self.put(&x.to_le_bytes()),
            MetaValue::I64(x) => self.put(&x.to_le_bytes()),
            MetaValue::F32(x) => self.put(&x.to_le_bytes()),
            MetaValue::F64(x) => self.put(&x.to_le_bytes()),
            MetaValue::Bool(x) => self.put(&[u8::from(*x)]),
            MetaValue::String(s) => self.string(s),
            MetaValue::Array(items) => {
                // The element type of an empty array is arbitrary; u8 is what llama.cpp
                // would read back as an empty array as well.
                let elem = items.first().map_or(0, MetaValue::type_id);
                self.put(&elem.to_le_bytes())?;
                self.put(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|item| self.value(item))
            }
        }
    }
}

/// Quantize f32 values (a whole number of blocks) to `ty`: F32, F16, BF16, Q8_0, Q4_0 or
/// Q4_1.
pub fn quantize(ty: GgmlType, data: &[f32]) -> Result<Vec<u8>, GgufError> {
    let (Some(bs), Some(bb)) = (ty.block_size(), ty.block_bytes()) else {
        return Err(GgufError::unsupported("<data>", ty));
    };
    let row: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => |x, y| {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        },
        GgmlType::F16 => |x, y| {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        },
        GgmlType::BF16 => |x, y| {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&fp32_to_bf16(*v).to_le_bytes());
            }
        },
        GgmlType::Q8_0 => |x, y| each_block(x, y, 32, 34, q8_0_block),
        GgmlType::Q4_0 => |x, y| each_block(x, y, 32, 18, q4_0_block),
        GgmlType::Q4_1 => |x, y| each_block(x, y, 32, 20, q4_1_block),
        GgmlType::IQ4NL => |x, y| each_block(x, y, 32, 18, iq4_nl_block),
        other => return Err(GgufError::unsupported("<data>", other)),
    };
    if !data.len().is_multiple_of(bs) {
        return Err(GgufError::BadShape {
            name: "<data>".to_owned(),
            reason: format!(
                "{} values are not a whole number of {} blocks",
                data.len(),
                ty.name()
            ),
        });
    }
    let mut out = vec![0u8; data.len() / bs * bb];
    let blocks_per_chunk = (CHUNK_ELEMENTS / bs).max(1);
    out.par_chunks_mut(blocks_per_chunk * bb)
        .zip(data.par_chunks(blocks_per_chunk * bs))
        .for_each(|(y, x)| row(x, y));
    Ok(out)
}

fn each_block(x: &[f32], y: &mut [u8], bs: usize, bb: usize, f: fn(&[f32], &mut [u8])) {
    for (xb, yb) in x.chunks_exact(bs).zip(y.chunks_exact_mut(bb)) {
        f(xb, yb);
    }
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even, NaN forced quiet.
fn fp32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
}

/// `quantize_row_q8_0_ref`: d = amax/127, q = round(x/d).
fn q8_0_block(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in y[2..].iter_mut().zip(x) {
        // `roundf` rounds half away from zero, like `f32::round`; the value is within
        // ±127 (the cast saturates anyway).
        *o = (v * id).round() as i8 as u8;
    }
}

/// `quantize_row_q4_0_ref`: d = max/−8 where max is the value of largest magnitude;
/// q = min(15, trunc(x/d + 8.5)).
fn q4_0_block(x: &[f32], y: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        // C converts with `(int8_t)`, i.e. truncation; `as` truncates too (and saturates
        // where C would be undefined).
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        y[2 + j] = q0 | (q1 << 4);
    }
}

/// IQ4_NL, simply: `d = max / −127` (`max` the value of largest magnitude, which so
/// takes the table's first entry) and each value the table entry nearest `x / d`.
/// ggml also searches nearby scales for a smaller error; this one is for writing test
/// models, not for quantizing real ones, so it need not give ggml's bytes.
fn iq4_nl_block(x: &[f32], y: &mut [u8]) {
    let mut max = 0.0f32;
    for &v in x {
        if max.abs() < v.abs() {
            max = v;
        }
    }
    let d = f16::from_f32(max / f32::from(IQ4_VALUES[0]));
    y[..2].copy_from_slice(&d.to_le_bytes());
    let d = d.to_f32();
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let nearest = |v: f32| -> u8 {
        let t = v * id;
        (0u8..16)
            .min_by(|&a, &b| {
                let da = (f32::from(IQ4_VALUES[usize::from(a)]) - t).abs();
                let db = (f32::from(IQ4_VALUES[usize::from(b)]) - t).abs();
                da.total_cmp(&db)
            })
            .unwrap_or(0)
    };
    for j in 0..16 {
        y[2 + j] = nearest(x[j]) | (nearest(x[j + 16]) << 4);
    }
}

/// `quantize_row_q4_1_ref`: d = (max − min)/15, m = min, q = min(15, trunc((x − m)/d + 0.5)).
fn q4_1_block(x: &[f32], y: &mut [u8]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    y[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    for j in 0..16 {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        y[4 + j] = q0 | (q1 << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::super::dequant::dequantize;
    use super::*;

    fn wave(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32))
            .collect()
    }

    #[test]
    fn quantizers_round_trip_within_error() {
        let x = wave(1024);
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 4e-3),
            (GgmlType::BF16, 3e-2),
            (GgmlType::Q8_0, 0.03),
            // Q4_0 can be off by a whole step (amax/8 < 0.9 here): level +8 is clipped
            // to +7.
            (GgmlType::Q4_0, 0.9),
            // Q4_1: half a step, (max − min)/30 < 0.47 here.
            (GgmlType::Q4_1, 0.5),
            // IQ4_NL: at most the table's widest step from its end, 127 − 113 = 14
            // units of amax/127 (< 0.8 here).
            (GgmlType::IQ4NL, 0.8),
        ] {
            let q = quantize(ty, &x).expect("supported");
            let y = dequantize(ty, &q, x.len()).expect("valid");
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= tol, "{ty}: max error {err} > {tol}");
        }
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(fp32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3·2^-8 rounds up.
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(fp32_to_bf16(f32::NAN) & 0x7fc0, 0x7fc0);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let q = quantize(GgmlType::Q4_0, &[0.0; 32]).expect("supported");
        let y = dequantize(GgmlType::Q4_0, &q, 32).expect("valid");
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn rejects_bad_input() {
        let mut w = GgufWriter::new();
        let e = w.add_tensor("t", &[33], GgmlType::Q8_0, &[0.0; 33]);
        assert_eq!(e.map_err(|e| e.kind()), Err("bad_shape"));
        let e = w.add_tensor("t", &[32], GgmlType::Q8_0, &[0.0; 31]);
        assert_eq!(e.map_err(|e| e.kind()), Err("bad_shape"));
        let e = w.add_tensor("t", &[256], GgmlType::Q4K, &[0.0; 256]);
        assert_eq!(e.map_err(|e| e.kind()), Err("unsupported_type"));
        w.add_tensor("t", &[32], GgmlType::F32, &[0.0; 32])
            .expect("valid");
        let e = w.add_tensor("t", &[32], GgmlType::F32, &[0.0; 32]);
        assert_eq!(e.map_err(|e| e.kind()), Err("duplicate_tensor"));
        w.add_metadata("k", MetaValue::U8(1)).expect("valid");
        let e = w.add_metadata("k", MetaValue::U8(1));
        assert_eq!(e.map_err(|e| e.kind()), Err("duplicate_key"));
        let mixed = MetaValue::Array(vec![MetaValue::U8(1), MetaValue::I8(1)]);
        let e = w.add_metadata("m", mixed);
        assert_eq!(e.map_err(|e| e.kind()), Err("wrong_type"));
    }
}
