//! cachet's ggml decoders against an independent implementation: for every tensor type both
//! cachet and candle know, blocks quantized by candle are dequantized by
//! `cachet_kernels::quant::dequantize_row_bytes` and by the repacked `QMatrix`, and by candle's
//! `QTensor::dequantize`; all three must agree bit for bit.

use cachet_kernels::quant::dequantize_row_bytes;
use cachet_kernels::{QMatrix, WeightType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

#[test]
fn every_shared_type_dequantizes_as_candle_does() {
    let (rows, cols) = (3usize, 512usize);
    // A deterministic spread of values with an outlier per row (exercises the scales).
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let x = ((i as u64 * 2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5;
            if i % 97 == 0 {
                x * 9.0
            } else {
                x
            }
        })
        .collect();
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).expect("tensor");
    for (dt, ty) in [
        (GgmlDType::F16, WeightType::F16),
        (GgmlDType::BF16, WeightType::BF16),
        (GgmlDType::Q8_0, WeightType::Q8_0),
        (GgmlDType::Q4_0, WeightType::Q4_0),
        (GgmlDType::Q4_1, WeightType::Q4_1),
        (GgmlDType::Q5_0, WeightType::Q5_0),
        (GgmlDType::Q5_1, WeightType::Q5_1),
        (GgmlDType::Q2K, WeightType::Q2K),
        (GgmlDType::Q3K, WeightType::Q3K),
        (GgmlDType::Q4K, WeightType::Q4K),
        (GgmlDType::Q5K, WeightType::Q5K),
        (GgmlDType::Q6K, WeightType::Q6K),
    ] {
        let q = QTensor::quantize(&t, dt).expect("quantize");
        let bytes = q.data().expect("bytes").into_owned();
        assert_eq!(bytes.len(), rows * ty.row_bytes(cols), "{ty:?} size");
        let want = q
            .dequantize(&Device::Cpu)
            .and_then(|x| x.flatten_all())
            .and_then(|x| x.to_vec1::<f32>())
            .expect("candle dequantize");
        let mut got = vec![f32::NAN; rows * cols];
        dequantize_row_bytes(ty, &bytes, &mut got).expect("dequantize");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{ty:?}: dequantize_row_bytes vs candle"
        );
        let m = QMatrix::from_gguf_bytes(ty, rows, cols, &bytes).expect("repack");
        let mut row = vec![f32::NAN; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(
                bits(&row),
                bits(&want[r * cols..(r + 1) * cols]),
                "{ty:?}: repacked row {r} vs candle"
            );
        }
    }
}
