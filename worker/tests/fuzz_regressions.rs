//! Replays every input in `fuzz/regressions/gguf/` (inputs the `gguf` fuzz target once
//! crashed on) through the target's own entry function, `baton_worker::fuzz::gguf`.

use std::path::Path;

#[test]
fn past_gguf_fuzz_crashes_stay_fixed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/gguf");
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        {
            continue;
        }
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("replaying {}", path.display());
        baton_worker::fuzz::gguf(&data);
    }
}
