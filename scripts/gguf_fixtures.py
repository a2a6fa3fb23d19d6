#!/usr/bin/env python3
"""Generate the GGUF test fixtures of `baton-worker` with an independent implementation.

Usage:
    python3 scripts/gguf_fixtures.py models/SmolLM2-135M-Instruct.Q4_1.gguf [--out DIR]

Needs the `gguf` and `numpy` packages (the ones llama.cpp publishes). Every fixture is a
small GGUF file written by `gguf.GGUFWriter`, so the Rust reader is exercised on files it
did not write itself, and every expected value is computed by `gguf.quants.dequantize`.

For each tensor type the Rust side dequantizes, the file `<type>.gguf` holds a tensor
`weight`, and `<type>.f32` holds its expected values (raw little-endian f32):

- F32, Q8_0, Q4_1: the first rows of real tensors of the default model, bytes unchanged.
- F16, BF16, Q4_0: real weights (rows of the dequantized token embedding) quantized with
  `gguf.quants.quantize`; the file also holds those weights as the F32 tensor `source`.
- Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS: the blocks are built
  from seeded random bytes with small positive f16 super-block scales. Dequantization is
  what is checked, and every bit pattern of the sub-block scales and quants is valid.

Q8_0 and Q4_1 files also hold `source` and `requantized` (the source quantized by
`gguf.quants.quantize`), so the Rust quantizers can be checked byte for byte.

`metadata.gguf` holds one key of every value type (nested arrays included), a custom
alignment of 64 and two odd-sized F32 tensors; `metadata.json` describes what a reader must
find in it. `manifest.json` lists the typed fixtures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

ROWS = 4
SEED = 20240607
K_BLOCKS = 4  # blocks in each random-block fixture (K-quant super-blocks of 256 values)


def write_gguf(path: Path, fixture_type: str, tensors: list[tuple[str, np.ndarray, T | None]]) -> None:
    """Write a GGUF file holding `tensors` (name, numpy data, raw type or None)."""
    writer = gguf.GGUFWriter(path, arch="fixture")
    writer.add_string("fixture.type", fixture_type)
    for name, data, raw_type in tensors:
        if raw_type is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_k_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    """Valid blocks (K-quant super-blocks, Q5_0 / Q5_1 blocks) from random bytes, with sane
    f16 scales."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(K_BLOCKS, type_size), dtype=np.uint8)
    d = f16_bytes(rng.uniform(2e-4, 2e-2, size=K_BLOCKS))
    dmin = f16_bytes(rng.uniform(2e-4, 2e-2, size=K_BLOCKS))
    if qtype == T.Q5_0:
        # Layout: d, qh[4], qs[16].
        raw[:, 0:2] = d
    elif qtype == T.Q5_1:
        # Layout: d, m, qh[4], qs[16].
        raw[:, 0:2] = d
        raw[:, 2:4] = dmin
    elif qtype in (T.Q4_K, T.Q5_K):
        # Layout: d, dmin, scales[12], (qh[32] for Q5_K), qs[128].
        raw[:, 0:2] = d
        raw[:, 2:4] = dmin
    elif qtype == T.Q6_K:
        # Layout: ql[128], qh[64], scales[16] (int8), d.
        raw[:, type_size - 2 :] = d
    elif qtype in (T.IQ4_NL, T.IQ4_XS):
        # Layout: d, then indices (IQ4_NL) or scales_h, scales_l[4], indices (IQ4_XS).
        raw[:, 0:2] = d
    else:
        raise ValueError(qtype)
    return raw


def main() -> None:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="the default model (SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("--out", type=Path, default=repo / "worker/tests/fixtures/gguf")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    model = gguf.GGUFReader(args.model)
    tensors = {t.name: t for t in model.tensors}
    rng = np.random.default_rng(SEED)

    def rows(name: str, n: int = ROWS) -> np.ndarray:
        return np.array(tensors[name].data[:n])

    # Real weights used as the source of the types the model lacks: rows of the token
    # embedding (Q8_0 in the model), dequantized. The last values are replaced by edge
    # cases of the f16/bf16 conversions (signed zero, subnormals, the largest f16).
    embd = tensors["token_embd.weight"]
    source = gguf.quants.dequantize(np.array(embd.data[1000 : 1000 + ROWS]), T.Q8_0).astype(np.float32)
    edge = np.array([0.0, -0.0, 5.96e-8, 6.1e-5, 65504.0, -65504.0, 1e-7, 3.1415927], dtype=np.float32)
    source_edge = source.copy()
    source_edge.reshape(-1)[-len(edge) :] = edge

    norms = np.stack([np.array(tensors[f"blk.{i}.attn_norm.weight"].data) for i in range(ROWS)])

    # (fixture name, type, weight data, source weights or None, origin)
    cases: list[tuple[str, T, np.ndarray, np.ndarray | None, str]] = [
        ("f32", T.F32, norms.astype(np.float32), None, "model: blk.0-3.attn_norm.weight"),
        ("f16", T.F16, gguf.quants.quantize(source_edge, T.F16), source_edge, "quantized real weights"),
        ("bf16", T.BF16, gguf.quants.quantize(source_edge, T.BF16), source_edge, "quantized real weights"),
        ("q8_0", T.Q8_0, rows("token_embd.weight"), None, "model: token_embd.weight rows 0-3"),
        ("q4_0", T.Q4_0, gguf.quants.quantize(source, T.Q4_0), source, "quantized real weights"),
        ("q4_1", T.Q4_1, rows("blk.0.attn_q.weight"), None, "model: blk.0.attn_q.weight rows 0-3"),
        ("q4_k", T.Q4_K, random_k_blocks(rng, T.Q4_K), None, "random blocks"),
        ("q5_k", T.Q5_K, random_k_blocks(rng, T.Q5_K), None, "random blocks"),
        ("q6_k", T.Q6_K, random_k_blocks(rng, T.Q6_K), None, "random blocks"),
        ("q5_0", T.Q5_0, random_k_blocks(rng, T.Q5_0), None, "random blocks"),
        ("q5_1", T.Q5_1, random_k_blocks(rng, T.Q5_1), None, "random blocks"),
        ("iq4_nl", T.IQ4_NL, random_k_blocks(rng, T.IQ4_NL), None, "random blocks"),
        ("iq4_xs", T.IQ4_XS, random_k_blocks(rng, T.IQ4_XS), None, "random blocks"),
    ]

    manifest = []
    for name, qtype, weight, src, origin in cases:
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS):
            weight = weight.reshape(2, -1)  # two rows of two super-blocks each
        expected = gguf.quants.dequantize(weight, qtype)
        expected = np.ascontiguousarray(expected, dtype=np.float32)

        entries: list[tuple[str, np.ndarray, T | None]] = []
        raw = None if qtype in (T.F32, T.F16) else qtype
        entries.append(("weight", weight, raw))
        requantized = None
        if src is not None:
            entries.append(("source", src.astype(np.float32), None))
        elif qtype in (T.Q8_0, T.Q4_1):
            entries.append(("source", source, None))
            requantized = "requantized"
            entries.append((requantized, gguf.quants.quantize(source, qtype), qtype))
        write_gguf(out / f"{name}.gguf", qtype.name, entries)
        (out / f"{name}.f32").write_bytes(expected.astype("<f4").tobytes())
        manifest.append(
            {
                "file": f"{name}.gguf",
                "type": qtype.name,
                "type_id": int(qtype),
                "tensor": "weight",
                "dims": list(reversed(expected.shape)),
                "expected": f"{name}.f32",
                "origin": origin,
                # When set: quantizing tensor `source` must give the bytes of this tensor.
                "quantized_source": "weight" if src is not None else requantized,
            }
        )

    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    write_metadata_fixture(out)


def write_metadata_fixture(out: Path) -> None:
    """One key of every value type, a custom alignment and odd-sized tensors."""
    writer = gguf.GGUFWriter(out / "metadata.gguf", arch="fixture")
    writer.add_custom_alignment(64)
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - the value a reader finds
    keys: list[tuple[str, object, V, V | None, object]] = [
        ("test.u8", 200, V.UINT8, None, 200),
        ("test.i8", -100, V.INT8, None, -100),
        ("test.u16", 60000, V.UINT16, None, 60000),
        ("test.i16", -30000, V.INT16, None, -30000),
        ("test.u32", 4_000_000_000, V.UINT32, None, 4_000_000_000),
        ("test.i32", -2_000_000_000, V.INT32, None, -2_000_000_000),
        ("test.u64", 18_000_000_000_000_000_000, V.UINT64, None, 18_000_000_000_000_000_000),
        ("test.i64", -9_000_000_000_000_000_000, V.INT64, None, -9_000_000_000_000_000_000),
        ("test.f32", 0.1, V.FLOAT32, None, f32(0.1)),
        ("test.f64", 0.1, V.FLOAT64, None, 0.1),
        ("test.bool_true", True, V.BOOL, None, True),
        ("test.bool_false", False, V.BOOL, None, False),
        ("test.string", "héllo, wörld ✓ <|im_end|>\n", V.STRING, None, "héllo, wörld ✓ <|im_end|>\n"),
        ("test.array_i32", [1, -2, 3], V.ARRAY, V.INT32, [1, -2, 3]),
        ("test.array_f32", [0.5, -1.25, 3.3], V.ARRAY, V.FLOAT32, [0.5, -1.25, f32(3.3)]),
        ("test.array_str", ["a", "", "ü"], V.ARRAY, V.STRING, ["a", "", "ü"]),
        ("test.array_bool", [True, False], V.ARRAY, V.BOOL, [True, False]),
        ("test.array_nested", [["x", "y"], ["z"]], V.ARRAY, V.ARRAY, [["x", "y"], ["z"]]),
    ]
    type_names = {
        V.UINT8: "U8", V.INT8: "I8", V.UINT16: "U16", V.INT16: "I16", V.UINT32: "U32",
        V.INT32: "I32", V.UINT64: "U64", V.INT64: "I64", V.FLOAT32: "F32", V.FLOAT64: "F64",
        V.BOOL: "Bool", V.STRING: "String", V.ARRAY: "Array",
    }

    def tagged(value: object, vtype: V, sub: V | None) -> dict:
        if vtype == V.ARRAY:
            assert isinstance(value, list) and sub is not None
            if sub == V.ARRAY:
                # The one nested array of the fixture holds arrays of strings.
                items = [tagged(v, V.ARRAY, V.STRING) for v in value]
            else:
                items = [tagged(v, sub, None) for v in value]
            return {"type": "Array", "value": items}
        return {"type": type_names[vtype], "value": value}

    expected: dict[str, dict] = {
        "general.architecture": tagged("fixture", V.STRING, None),
        "general.alignment": tagged(64, V.UINT32, None),
    }
    for key, value, vtype, sub, seen in keys:
        writer.add_key_value(key, value, vtype, sub_type=sub)
        expected[key] = tagged(seen, vtype, sub)

    odd = [("odd3", np.array([1.5, -2.0, 3.25], dtype=np.float32)), ("odd5", np.arange(5, dtype=np.float32) / 7)]
    for name, data in odd:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    doc = {
        "alignment": 64,
        "metadata": expected,
        "tensors": [{"name": n, "dims": [len(d)], "type": "F32", "values": [float(v) for v in d]} for n, d in odd],
    }
    (out / "metadata.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
