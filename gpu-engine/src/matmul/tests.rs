//! Every kernel set this CPU has against the portable reference, on every weight type, with row
//! lengths of even and odd block counts and token counts that take every tiling path.

use super::*;

/// A deterministic pseudo-random stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f32 {
        (self.next() % 20_001) as f32 / 10_000.0 - 1.0
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_le_bytes()
}

/// A matrix's bytes in the file's block layout (GGUF), random quants and scales.
fn file_bytes(ty: TensorType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend_from_slice(&f16_bytes(rng.unit() * 0.05));
        match ty {
            TensorType::Q4_1 => {
                data.extend_from_slice(&f16_bytes(rng.unit() * 0.1));
                data.extend((0..16).map(|_| rng.next() as u8));
            }
            TensorType::Q4_0 => data.extend((0..16).map(|_| rng.next() as u8)),
            // Every byte value, -128 included.
            _ => data.extend((0..32).map(|_| rng.next() as u8)),
        }
    }
    data
}

fn matrix(ty: TensorType, rows: usize, cols: usize, rng: &mut Rng) -> QMatrix {
    QMatrix::from_file(ty, rows, cols, &file_bytes(ty, rows, cols, rng)).expect("fits")
}

#[test]
fn every_kernel_set_matches_the_portable_reference() {
    let sets = Kernels::available();
    eprintln!(
        "kernel sets on this CPU: {:?}",
        sets.iter().map(|k| k.name()).collect::<Vec<_>>()
    );
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for ty in [TensorType::Q4_1, TensorType::Q4_0, TensorType::Q8_0] {
        // 3 and 7 blocks: a padding block; 8: pairs only. 37 rows: an odd last row.
        for cols in [96, 224, 256, 576, 1056] {
            let rows = 37;
            let m = matrix(ty, rows, cols, &mut rng);
            for tokens in [1, 2, 3, 4, 9] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit() * 3.0).collect();
                let acts = QActs::new(&x, &m);
                let mut want = vec![0.0f32; tokens * rows];
                m.matmul_with(Kernels::portable(), &acts, &mut want);
                for &k in &sets {
                    let mut got = vec![0.0f32; tokens * rows];
                    m.matmul_with(k, &acts, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let tol = 1e-4 * (1.0 + w.abs());
                        assert!(
                            (g - w).abs() <= tol,
                            "{} {ty:?} cols {cols} tokens {tokens} [{i}]: {g} vs {w}",
                            k.name()
                        );
                    }
                }
            }
        }
    }
}

/// The dot product on the file's own block layout (GGUF), written independently of the kernel
/// layout: what every packed kernel must compute.
fn file_dot(ty: TensorType, file_row: &[u8], x: &Acts<'_>) -> f32 {
    let (_, bb) = ty.block();
    let mut acc = 0.0f32;
    for (b, blk) in file_row.chunks_exact(bb as usize).enumerate() {
        let mut isum = 0i32;
        for j in 0..32 {
            let w = match ty {
                TensorType::Q8_0 => blk[2 + j] as i8 as i32,
                _ => {
                    let off = if ty == TensorType::Q4_1 { 4 } else { 2 };
                    let byte = blk[off + j % 16];
                    let u = i32::from(if j < 16 { byte & 0x0f } else { byte >> 4 });
                    if ty == TensorType::Q4_0 { u - 8 } else { u }
                }
            };
            isum += w * x.q[b][j] as i32;
        }
        acc += f16_le(blk, 0) * x.d[b] * isum as f32;
        if ty == TensorType::Q4_1 {
            acc += f16_le(blk, 2) * x.s[b];
        }
    }
    acc
}

#[test]
fn packing_keeps_every_weight_and_scale() {
    let mut rng = Rng(0x0dd_ba11);
    for ty in [TensorType::Q4_1, TensorType::Q4_0, TensorType::Q8_0] {
        for cols in [32, 96, 256, 1056] {
            let rows = 5;
            let fb = ty.bytes_for(cols as u64).expect("blocks") as usize;
            let bytes = file_bytes(ty, rows, cols, &mut rng);
            assert!(QMatrix::from_file(ty, rows, cols, &bytes[1..]).is_none());
            let m = QMatrix::from_file(ty, rows, cols, &bytes).expect("fits");
            // Dequantised rows equal the file's.
            for row in 0..rows {
                let mut want = vec![0.0f32; cols];
                crate::quant::dequantize(ty, &bytes[row * fb..(row + 1) * fb], &mut want)
                    .expect("dequantises");
                let mut got = vec![0.0f32; cols];
                m.row(row, &mut got);
                assert_eq!(got, want, "{ty:?} cols {cols} row {row}");
            }
            // Every kernel set's product equals the file-layout dot product.
            let x: Vec<f32> = (0..3 * cols).map(|_| rng.unit() * 2.0).collect();
            let acts = QActs::new(&x, &m);
            for &k in &Kernels::available() {
                let mut got = vec![0.0f32; 3 * rows];
                m.matmul_with(k, &acts, &mut got);
                for t in 0..3 {
                    for row in 0..rows {
                        let want = file_dot(ty, &bytes[row * fb..(row + 1) * fb], &acts.token(t));
                        let g = got[t * rows + row];
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{} {ty:?} cols {cols} token {t} row {row}: {g} vs {want}",
                            k.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stacked_matrices_write_their_columns_of_a_wider_output() {
    let mut rng = Rng(0xc0ffee);
    let (a, b) = (
        matrix(TensorType::Q4_1, 19, 96, &mut rng),
        matrix(TensorType::Q4_1, 7, 96, &mut rng),
    );
    let ab = a.stack(&b).expect("same type and width");
    assert_eq!(ab.rows, 26);
    assert!(
        a.stack(&matrix(TensorType::Q8_0, 7, 96, &mut rng))
            .is_none()
    );
    assert!(
        a.stack(&matrix(TensorType::Q4_1, 7, 64, &mut rng))
            .is_none()
    );
    for tokens in [1, 5] {
        let x: Vec<f32> = (0..tokens * 96).map(|_| rng.unit()).collect();
        let acts = QActs::new(&x, &a);
        let (mut oa, mut ob) = (vec![0.0; tokens * 19], vec![0.0; tokens * 7]);
        a.matmul(&acts, &mut oa);
        b.matmul(&acts, &mut ob);
        let mut both = vec![f32::NAN; tokens * 26];
        ab.matmul(&acts, &mut both);
        // Into columns 3.. of a 30-wide buffer: the rest untouched.
        let mut wide = vec![-1.0f32; tokens * 30];
        ab.matmul_into(Kernels::chosen(), &acts, &mut wide, 30, 3);
        for t in 0..tokens {
            assert_eq!(&both[t * 26..t * 26 + 19], &oa[t * 19..(t + 1) * 19]);
            assert_eq!(&both[t * 26 + 19..(t + 1) * 26], &ob[t * 7..(t + 1) * 7]);
            assert_eq!(&wide[t * 30 + 3..t * 30 + 29], &both[t * 26..(t + 1) * 26]);
            assert!(
                wide[t * 30..t * 30 + 3]
                    .iter()
                    .chain(&wide[t * 30 + 29..(t + 1) * 30])
                    .all(|v| *v == -1.0)
            );
        }
    }
}

/// A token's products do not depend on the tokens computed beside it: the same bits alone as in
/// a batch (a migrated stream's prompt recomputes, in a prefill, tokens first computed one at a
/// time in a decode, and greedy resumption depends on them being equal).
#[test]
fn a_token_gets_the_same_bits_alone_as_in_a_batch() {
    let mut rng = Rng(0x5eed_0042_0042_0001);
    for ty in [TensorType::Q4_1, TensorType::Q4_0, TensorType::Q8_0] {
        for cols in [96, 576, 1056] {
            let rows = 23;
            let m = matrix(ty, rows, cols, &mut rng);
            let tokens = 7;
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit() * 3.0).collect();
            for k in Kernels::available() {
                let mut batch = vec![0.0f32; tokens * rows];
                m.matmul_with(k, &QActs::new(&x, &m), &mut batch);
                for t in 0..tokens {
                    let one = &x[t * cols..(t + 1) * cols];
                    let mut alone = vec![0.0f32; rows];
                    m.matmul_with(k, &QActs::new(one, &m), &mut alone);
                    let got: Vec<u32> = batch[t * rows..(t + 1) * rows]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let want: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{} {ty:?} cols {cols} token {t}", k.name());
                }
            }
        }
    }
}
