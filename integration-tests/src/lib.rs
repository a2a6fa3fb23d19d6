//! End-to-end tests of Baton: real processes driven as users drive them.
//!
//! # Layout
//! - [`workspace_root`]: where the repository lives, to find binaries and models.

use std::path::PathBuf;

/// The repository root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}
