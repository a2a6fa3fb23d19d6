//! The checks a model file passes before a running worker loads it beside what it
//! serves: the file is there, its SHA-256 is the one expected, the engine can run it
//! (preflight: architecture, tokenizer, every tensor and hyperparameter), and this host
//! has the memory for it. Each failure names the file and the problem; nothing is
//! loaded until all pass.

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _};
use sha2::{Digest, Sha256};

use crate::engine::{
    gguf::GgufFile,
    llama::{preflight::preflight, WeightDtype},
};

/// The SHA-256 a file must have: the one given, or the first word of `<file>.sha256`.
fn expected_sha256(path: &Path, given: Option<&str>) -> anyhow::Result<(String, String)> {
    let (hex, from) = match given {
        Some(h) => (h.trim().to_ascii_lowercase(), "the one given".to_owned()),
        None => {
            let beside = PathBuf::from(format!("{}.sha256", path.display()));
            let text = std::fs::read_to_string(&beside).with_context(|| {
                format!(
                    "no SHA-256 given and none readable beside the file at {}",
                    beside.display()
                )
            })?;
            let word = text.split_whitespace().next().unwrap_or_default();
            (word.to_ascii_lowercase(), format!("{}", beside.display()))
        }
    };
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("the SHA-256 expected ({from}) is not 64 hex digits: {hex:?}");
    }
    Ok((hex, from))
}

/// The SHA-256 of a file, hex.
pub fn sha256_of(path: &Path) -> anyhow::Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Bytes the weights of `gguf` take in memory as `weights`: the file's blocks as they
/// are for the native formats, 2 or 4 bytes an element for f16 and f32.
pub fn weight_bytes(gguf: &GgufFile, weights: WeightDtype) -> u64 {
    gguf.tensors()
        .iter()
        .map(|t| match weights {
            WeightDtype::Native | WeightDtype::NativeI16 | WeightDtype::NativeI8 => t.n_bytes,
            WeightDtype::F16 => t.n_elements * 2,
            WeightDtype::F32 => t.n_elements * 4,
        })
        .sum()
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (`None` where there is none).
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Every check of a model file before it loads beside the models served. `available`:
/// the memory this host has free (`None`: unknown, not checked).
pub fn check_model_file(
    path: &Path,
    sha256: Option<&str>,
    weights: WeightDtype,
    available: Option<u64>,
) -> anyhow::Result<()> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("no model file at {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is not a file", path.display());
    }
    let (want, from) = expected_sha256(path, sha256)?;
    let got = sha256_of(path)?;
    if got != want {
        bail!(
            "{}: its SHA-256 is {got}, not {want} ({from}); the file is not the one expected \
             (or not completely written)",
            path.display()
        );
    }
    let gguf = GgufFile::open(path)
        .with_context(|| format!("{} is not a GGUF file this worker can read", path.display()))?;
    preflight(&gguf).with_context(|| format!("{}: this worker cannot run it", path.display()))?;
    let need = weight_bytes(&gguf, weights);
    if let Some(free) = available {
        if need > free {
            bail!(
                "{} needs about {} MiB for its weights as {weights}; this host has {} MiB \
                 available beside the models served",
                path.display(),
                need >> 20,
                free >> 20
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arch/qwen2.q8_0.gguf")
    }

    fn copy_to(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).expect("write");
        p
    }

    #[test]
    fn a_good_file_passes_with_its_hash_given_or_beside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = std::fs::read(fixture()).expect("fixture");
        let p = copy_to(dir.path(), "m.gguf", &bytes);
        let sha = sha256_of(&p).expect("sha");
        check_model_file(&p, Some(&sha.to_uppercase()), WeightDtype::Native, None).expect("given");
        let err = check_model_file(&p, None, WeightDtype::Native, None).expect_err("none");
        assert!(format!("{err:#}").contains("no SHA-256 given"), "{err:#}");
        std::fs::write(dir.path().join("m.gguf.sha256"), format!("{sha}  m.gguf\n"))
            .expect("write");
        check_model_file(&p, None, WeightDtype::Native, None).expect("beside");
    }

    #[test]
    fn each_bad_file_is_refused_naming_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = std::fs::read(fixture()).expect("fixture");
        let err = |p: &Path, sha: Option<&str>, available: Option<u64>| {
            format!(
                "{:#}",
                check_model_file(p, sha, WeightDtype::Native, available).expect_err("refused")
            )
        };
        let missing = dir.path().join("missing.gguf");
        assert!(err(&missing, Some(&"0".repeat(64)), None).contains("no model file"));
        let p = copy_to(dir.path(), "m.gguf", &bytes);
        let e = err(&p, Some(&"0".repeat(64)), None);
        assert!(
            e.contains("its SHA-256 is") && e.contains("not the one expected"),
            "{e}"
        );
        assert!(err(&p, Some("abc"), None).contains("not 64 hex digits"));
        let text = copy_to(dir.path(), "t.gguf", b"not a model at all\n");
        let e = err(&text, Some(&sha256_of(&text).expect("sha")), None);
        assert!(e.contains("not a GGUF file"), "{e}");
        let cut = copy_to(dir.path(), "cut.gguf", &bytes[..bytes.len() / 2]);
        let e = err(&cut, Some(&sha256_of(&cut).expect("sha")), None);
        assert!(e.contains("not a GGUF file"), "{e}");
        // Another architecture: every "qwen2" (its name and its keys' prefix) renamed.
        let renamed: Vec<u8> = {
            let mut b = bytes.clone();
            let mut i = 0;
            while let Some(j) = b[i..].windows(5).position(|w| w == b"qwen2") {
                b[i + j..i + j + 5].copy_from_slice(b"mamba");
                i += j + 5;
            }
            b
        };
        let other = copy_to(dir.path(), "o.gguf", &renamed);
        let e = err(&other, Some(&sha256_of(&other).expect("sha")), None);
        assert!(e.contains("cannot run it") && e.contains("mamba"), "{e}");
        let e = err(&p, Some(&sha256_of(&p).expect("sha")), Some(1024));
        assert!(e.contains("MiB available"), "{e}");
    }
}
