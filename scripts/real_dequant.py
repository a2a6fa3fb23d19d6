#!/usr/bin/env python3
"""What the `gguf` package dequantizes real tensors to, for the dequantizer's test.

Usage:
    python3 scripts/real_dequant.py NAME=PATH... [--out DIR]

For each model file, every tensor type in it, the first two tensors of that type (in the
file's order): the SHA-256 of the whole tensor dequantized by `gguf.quants.dequantize`
to little-endian float32, and its first eight values. Writes `<DIR>/<NAME>.dequant.json`
(default DIR `worker/tests/fixtures/real`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="NAME=PATH of a GGUF file")
    parser.add_argument("--out", type=Path, default=repo / "worker/tests/fixtures/real")
    args = parser.parse_args()
    for spec in args.models:
        name, path = spec.split("=", 1)
        reader = gguf.GGUFReader(path)
        seen: dict[str, int] = {}
        tensors = []
        for t in reader.tensors:
            ty = t.tensor_type.name
            if seen.get(ty, 0) >= 2:
                continue
            seen[ty] = seen.get(ty, 0) + 1
            values = gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype("<f4").reshape(-1)
            tensors.append(
                {
                    "name": t.name,
                    "type": ty,
                    "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
                    "first": [float(v) for v in values[:8]],
                }
            )
            print(f"{name}: {t.name} {ty}")
        doc = {"source": {"script": "scripts/real_dequant.py", "gguf": getattr(gguf, "__version__", "?")}, "tensors": tensors}
        (args.out / f"{name}.dequant.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
