//! Hand-built blocks of the types added after the first seven (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K,
//! IQ4_NL, IQ4_XS, BF16): `dequantize_block` and the repacked matrix's `dequantize_row` give
//! the values derived by hand from ggml's `dequantize_row_*` (each derivation in a comment).

use cachet_kernels::quant::{dequantize_block, q3k_scales, q4k_pack_scales};
use cachet_kernels::{QMatrix, WeightType};
use half::f16;

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// `dequantize_block` of `bytes`, checked against the repacked matrix's row (one block row).
fn dequant(ty: WeightType, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![f32::NAN; ty.block_len()];
    dequantize_block(ty, bytes, &mut out).unwrap();
    let m = QMatrix::from_gguf_bytes(ty, 1, ty.block_len(), bytes).unwrap();
    let mut row = vec![f32::NAN; ty.block_len()];
    m.dequantize_row(0, &mut row);
    assert_eq!(row, out, "{ty:?}: repacked row differs from the block");
    out
}

#[test]
fn q5_0_hand_block() {
    // d = 0.5; qh = 0x8000_0001: fifth bit of value 0 (bit 0) and of value 31 (bit 15 + 16);
    // qs[j] = j | (15 − j) << 4: value j has low bits j, value j + 16 low bits 15 − j.
    let mut b = vec![0u8; 22];
    b[..2].copy_from_slice(&h(0.5));
    b[2..6].copy_from_slice(&0x8000_0001u32.to_le_bytes());
    for j in 0..16 {
        b[6 + j] = j as u8 | ((15 - j as u8) << 4);
    }
    let y = dequant(WeightType::Q5_0, &b);
    // x = d · (code − 16): value 0: code 16 → 0; value 1: code 1 → −7.5; value 15: code 15 →
    // −0.5; value 16: code 15 → −0.5; value 30: code 1 → −7.5; value 31: code 16 → 0.
    assert_eq!(
        [y[0], y[1], y[15], y[16], y[30], y[31]],
        [0.0, -7.5, -0.5, -0.5, -7.5, 0.0]
    );
    // value 5: code 5 → −5.5; value 20: code 11 → −2.5.
    assert_eq!([y[5], y[20]], [-5.5, -2.5]);
}

#[test]
fn q5_1_hand_block() {
    // d = 0.25, m = −1; qh = 0x0001_0002: fifth bits of value 1 and value 16;
    // qs[j] = j | (3j mod 16) << 4.
    let mut b = vec![0u8; 24];
    b[..2].copy_from_slice(&h(0.25));
    b[2..4].copy_from_slice(&h(-1.0));
    b[4..8].copy_from_slice(&0x0001_0002u32.to_le_bytes());
    for j in 0..16 {
        b[8 + j] = j as u8 | ((((3 * j) % 16) as u8) << 4);
    }
    let y = dequant(WeightType::Q5_1, &b);
    // x = d · code + m: value 0: 0 → −1; value 1: 17 → 3.25; value 15: 15 → 2.75;
    // value 16: 0 | 16 → 3; value 17: 3 → −0.25; value 31: 45 mod 16 = 13 → 2.25.
    assert_eq!(
        [y[0], y[1], y[15], y[16], y[17], y[31]],
        [-1.0, 3.25, 2.75, 3.0, -0.25, 2.25]
    );
}

#[test]
fn iq4_nl_hand_block() {
    // d = 2; qs[j] = j | (15 − j) << 4; levels −127 −104 −83 −65 −49 −35 −22 −10 1 13 25 38
    // 53 69 89 113.
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&h(2.0));
    for j in 0..16 {
        b[2 + j] = j as u8 | ((15 - j as u8) << 4);
    }
    let y = dequant(WeightType::IQ4NL, &b);
    // value 0: 2·−127; value 8: 2·1; value 15: 2·113; value 16 (index 15): 226;
    // value 31 (index 0): −254; value 23 (index 8): 2.
    assert_eq!(
        [y[0], y[8], y[15], y[16], y[31], y[23]],
        [-254.0, 2.0, 226.0, 226.0, -254.0, 2.0]
    );
}

#[test]
fn q2_k_hand_block() {
    // d = 0.5, dmin = 0.25; scales (sc | m << 4): sub 0: 0x21 (sc 1, m 2), sub 1: 0x13
    // (sc 3, m 1), sub 9: 0x05 (sc 5, m 0), the rest 0. Sub-block s = 8n + 2j + h holds values
    // 16s..16s+16, codes = bits 2j.. of qs[32n + 16h + l].
    let mut b = vec![0u8; 84];
    b[0] = 0x21;
    b[1] = 0x13;
    b[9] = 0x05;
    b[16] = 0xE4; // qs[0]: codes 0, 1, 2, 3 for j = 0..3 (subs 0, 2, 4, 6 at l = 0)
    b[16 + 16] = 0x03; // qs[16]: code 3 for sub 1, l = 0
    b[16 + 48] = 0x02; // qs[48]: code 2 for sub 9 (n 1, j 0, h 1), l = 0
    b[80..82].copy_from_slice(&h(0.5));
    b[82..84].copy_from_slice(&h(0.25));
    let y = dequant(WeightType::Q2K, &b);
    // x = d·sc·q − dmin·m: value 0: 0.5·1·0 − 0.25·2 = −0.5; value 1: same code 0 → −0.5;
    // value 16: 0.5·3·3 − 0.25·1 = 4.25; value 32 (sub 2, scale 0): 0; value 144 (sub 9):
    // 0.5·5·2 − 0 = 5.
    assert_eq!(
        [y[0], y[1], y[16], y[32], y[144]],
        [-0.5, -0.5, 4.25, 0.0, 5.0]
    );
}

#[test]
fn q3_k_scales_unpack_by_hand() {
    // Scale s: low nibble in byte s (s < 8) or the high nibble of byte s − 8; high 2 bits in
    // bits 2·(s / 4) of byte 8 + s % 4. All 32 (low 0, high 2 = 0xAA bytes) except
    // s0 = 33 (byte 0 = 1), s1 = 34 (byte 1 = 2), s5 = 30 = 0b01_1110 (byte 5 = 0x0E, byte 9
    // bits 2–3 = 01: 0xA6), s15 = 63 (byte 7 = 0xF0, byte 11 bits 6–7 = 11: 0xEA).
    let packed = [1, 2, 0, 0, 0, 0x0E, 0, 0xF0, 0xAA, 0xA6, 0xAA, 0xEA];
    let want = [
        33, 34, 32, 32, 32, 30, 32, 32, 32, 32, 32, 32, 32, 32, 32, 63,
    ];
    assert_eq!(q3k_scales(&packed), want);
}

#[test]
fn q3_k_hand_block() {
    // The scales of `q3_k_scales_unpack_by_hand` (sub 0: +1, sub 1: +2, sub 5: −2, sub 15:
    // +31, the rest 0) and d = 1. Level = low2 − (hmask bit ? 0 : 4), low2 = bits 2j.. of
    // qs[32n + 16h + l], hmask bit 4n + j of hmask[16h + l].
    let mut b = vec![0u8; 110];
    b[..32].fill(0xFF);
    b[0] = 0xFE; // value 0 (sub 0, l 0): bit 0 clear → −4
    b[17] = 0x7F; // value 241 (sub 15, l 1): bit 7 clear → −4
    b[32] = 0x03; // qs[0]: low2 3 for sub 0, l 0
    b[32 + 16] = 0x32; // qs[16]: low2 2 for sub 1 (j 0), 3 for sub 5 (j 2), l 0
    b[32 + 48] = 0xC0; // qs[48]: low2 3 for sub 15 (n 1, j 3, h 1), l 0
    b[96..108].copy_from_slice(&[1, 2, 0, 0, 0, 0x0E, 0, 0xF0, 0xAA, 0xA6, 0xAA, 0xEA]);
    b[108..110].copy_from_slice(&h(1.0));
    let y = dequant(WeightType::Q3K, &b);
    // value 0: 1·(3 − 4) = −1; value 1: 1·0 = 0; value 16: 2·2 = 4; value 80 (sub 5): −2·3
    // = −6; value 240 (sub 15): 31·3 = 93; value 241: 31·(0 − 4) = −124.
    assert_eq!(
        [y[0], y[1], y[16], y[80], y[240], y[241]],
        [-1.0, 0.0, 4.0, -6.0, 93.0, -124.0]
    );
}

#[test]
fn q5_k_hand_block() {
    // d = 1, dmin = 0.5; scales (Q4_K's packing) ls = [1, 2, 0, 0, 0, 0, 0, 3], lm = [4, 0, 0,
    // 0, 0, 0, 0, 1]. Sub-block 2j: low nibbles of qs[32j..], sub 2j + 1 the high ones; the
    // fifth bit of sub s, value l is bit s of qh[l].
    let mut b = vec![0u8; 176];
    b[..2].copy_from_slice(&h(1.0));
    b[2..4].copy_from_slice(&h(0.5));
    b[4..16].copy_from_slice(&q4k_pack_scales(
        &[1, 2, 0, 0, 0, 0, 0, 3],
        &[4, 0, 0, 0, 0, 0, 0, 1],
    ));
    b[16] = 0b1000_0011; // qh[0]: fifth bits of subs 0, 1 and 7 at l = 0
    b[48] = 0x5A; // qs[0]: sub 0 low 10, sub 1 low 5
    b[48 + 96] = 0xF0; // qs[96]: sub 7 low 15
    let y = dequant(WeightType::Q5K, &b);
    // x = d·sc·q − dmin·m: value 0: 1·26 − 0.5·4 = 24; value 1: 0 − 2 = −2; value 32 (sub 1):
    // 2·21 = 42; value 224 (sub 7): 3·31 − 0.5 = 92.5.
    assert_eq!([y[0], y[1], y[32], y[224]], [24.0, -2.0, 42.0, 92.5]);
}

#[test]
fn iq4_xs_hand_block() {
    // d = 0.5; ls = low nibble (scales_l[ib / 2] >> 4·(ib % 2)) | 2 bits of scales_h << 4:
    // scales_l[0] = 0x21, scales_h = 0b1110: ls0 = 1 | 2 << 4 = 33 (dl 0.5), ls1 = 2 | 3 << 4
    // = 50 (dl 9), the rest 0 (dl 0.5·−32 = −16).
    let mut b = vec![0u8; 136];
    b[..2].copy_from_slice(&h(0.5));
    b[2..4].copy_from_slice(&0b1110u16.to_le_bytes());
    b[4] = 0x21;
    b[8] = 0xF0; // sub 0: value 0 index 0, value 16 index 15
    b[8 + 16] = 0x08; // sub 1: value 32 index 8, value 48 index 0
    let y = dequant(WeightType::IQ4XS, &b);
    // value 0: 0.5·−127 = −63.5; value 1 (index 0): −63.5; value 16: 0.5·113 = 56.5;
    // value 32: 9·1 = 9; value 48: 9·−127 = −1143; value 64 (sub 2, index 0): −16·−127 = 2032.
    assert_eq!(
        [y[0], y[1], y[16], y[32], y[48], y[64]],
        [-63.5, -63.5, 56.5, 9.0, -1143.0, 2032.0]
    );
}

#[test]
fn bf16_hand_values() {
    // BF16 is the top half of an f32: 0x3F80 = 1.0, 0xC040 = −3.0, 0x3FC0 = 1.5.
    let b = [0x80, 0x3F, 0x40, 0xC0, 0xC0, 0x3F];
    let mut out = [0f32; 3];
    for (o, c) in out.iter_mut().zip(b.chunks(2)) {
        dequantize_block(WeightType::BF16, c, std::slice::from_mut(o)).unwrap();
    }
    assert_eq!(out, [1.0, -3.0, 1.5]);
    let m = QMatrix::from_gguf_bytes(WeightType::BF16, 1, 3, &b).unwrap();
    let mut row = [0f32; 3];
    m.dequantize_row(0, &mut row);
    assert_eq!(row, [1.0, -3.0, 1.5]);
}

#[test]
fn type_names_and_ids() {
    for (ty, id, name) in [
        (WeightType::Q5_0, 6, "Q5_0"),
        (WeightType::Q5_1, 7, "Q5_1"),
        (WeightType::Q2K, 10, "Q2_K"),
        (WeightType::Q3K, 11, "Q3_K"),
        (WeightType::Q5K, 13, "Q5_K"),
        (WeightType::IQ4NL, 20, "IQ4_NL"),
        (WeightType::IQ4XS, 23, "IQ4_XS"),
        (WeightType::BF16, 30, "BF16"),
    ] {
        assert_eq!((ty.ggml_type_id(), ty.ggml_name()), (id, name));
        assert_eq!(WeightType::from_ggml_type_id(id).unwrap(), ty);
    }
    let err = WeightType::from_ggml_type_id(16).unwrap_err().to_string();
    assert!(
        err.contains("ggml type id 16") && err.contains("IQ4_XS"),
        "{err}"
    );
}
