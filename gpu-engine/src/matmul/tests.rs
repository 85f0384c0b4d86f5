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

fn matrix(ty: TensorType, rows: usize, cols: usize, rng: &mut Rng) -> QMatrix {
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
    QMatrix {
        ty,
        rows,
        cols,
        data,
    }
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
        // 3 and 7 blocks: the AVX-512 kernel's odd last block; 8: pairs only.
        for cols in [96, 224, 256] {
            let rows = 37;
            let m = matrix(ty, rows, cols, &mut rng);
            for tokens in [1, 3, 4, 9] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit() * 3.0).collect();
                let acts = QActs::new(&x, cols, m.wants_sum());
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
