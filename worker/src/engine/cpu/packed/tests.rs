use super::*;

/// The vector dequantization gives the portable loop's bits.
#[test]
fn dequantized_rows_are_the_same_bits_everywhere() {
    for kind in [QKind::Five, QKind::Six, QKind::FiveMin] {
        for nb in [1, 2, 3, 8] {
            let qs: Vec<u8> = (0..nb * block_bytes(kind))
                .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(7) as u8)
                .collect();
            let scales: Vec<f32> = (0..nb * scales_per_block(kind))
                .map(|i| 0.01 + i as f32 * 0.37e-3)
                .collect();
            let mins: Vec<f32> = if kind.has_mins() {
                (0..nb).map(|i| -0.3 + i as f32 * 0.071).collect()
            } else {
                Vec::new()
            };
            let mut fast = vec![0.0f32; nb * BLOCK];
            dequant_row(kind, &qs, &scales, &mins, &mut fast);
            for (b, block) in qs.chunks_exact(block_bytes(kind)).enumerate() {
                let v = unpack(kind, block);
                for i in 0..BLOCK {
                    let d = scales[b * scales_per_block(kind) + i * scales_per_block(kind) / BLOCK];
                    let mut want = f32::from(v[i]) * d;
                    if let Some(m) = mins.get(b) {
                        want += m;
                    }
                    assert_eq!(fast[b * BLOCK + i].to_bits(), want.to_bits(), "{kind:?}");
                }
            }
        }
    }
}

#[test]
fn packing_round_trips() {
    for (kind, range) in [(QKind::Five, 32u32), (QKind::Six, 64), (QKind::FiveMin, 32)] {
        for seed in 0..50u32 {
            let q: [u8; BLOCK] = std::array::from_fn(|i| {
                ((i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed * 40503)
                    >> 7) as u8
                    % range as u8
            });
            let mut packed = Vec::new();
            pack(kind, &q, &mut packed);
            assert_eq!(packed.len(), block_bytes(kind));
            let bias = if kind.has_mins() {
                0
            } else {
                (range / 2) as i8
            };
            let want: Vec<i8> = q.iter().map(|&v| v as i8 - bias).collect();
            assert_eq!(unpack(kind, &packed).to_vec(), want, "{kind:?}");
        }
    }
}
