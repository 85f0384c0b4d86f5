//! Unit tests of the attention kernels' arithmetic.

use super::{accumulate, dot_f32, exp_neg, scores_rows, scores_t};

fn noise(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    }
}

/// The decode path's scores, eight rows at a time with AVX2, are [`dot_f32`]'s bit for bit
/// (and so the transposed prefill tile's), for every row count of a page and head widths
/// with and without a remainder.
#[test]
fn decode_scores_equal_the_dot_products_bit_for_bit() {
    let mut next = noise(0x1234_5678_9abc_def1);
    for hd in [64, 60, 128, 8, 12] {
        for n in 1..=32 {
            let q: Vec<f32> = (0..hd).map(|_| next()).collect();
            let k: Vec<f32> = (0..n * hd).map(|_| next()).collect();
            let want: Vec<u32> = (0..n)
                .map(|s| dot_f32(&q, &k[s * hd..(s + 1) * hd]).to_bits())
                .collect();
            let mut got = [0.0f32; 32];
            scores_rows::<false>(&q, &k, n, &mut got);
            assert_eq!(
                got[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want
            );
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::Kernels::available()
                .iter()
                .any(|k| k.level() >= crate::cpu::Level::Avx2)
            {
                let mut got = [0.0f32; 32];
                scores_rows::<true>(&q, &k, n, &mut got);
                let got: Vec<u32> = got[..n].iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "hd {hd} n {n}");
            }
        }
    }
}

/// The V update in registers adds each element's terms in slot order, as the plain loop
/// does: the same bits.
#[test]
fn the_value_update_adds_in_slot_order() {
    let mut next = noise(0x0bad_cafe_f00d_1234);
    for hd in [64, 60, 128, 40] {
        for n in [1, 5, 16, 32] {
            let p: Vec<f32> = (0..n).map(|_| next().abs() / 4.0).collect();
            let v: Vec<f32> = (0..n * hd).map(|_| next()).collect();
            let start: Vec<f32> = (0..hd).map(|_| next()).collect();
            let mut want = start.clone();
            for (s, ps) in p.iter().enumerate() {
                for (o, x) in want.iter_mut().zip(&v[s * hd..(s + 1) * hd]) {
                    *o += ps * x;
                }
            }
            let mut got = start.clone();
            accumulate(&mut got, &p, &v, hd);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "hd {hd} n {n}"
            );
        }
    }
}

/// Over an f16 cache a decode step reads K and V as stored: its scores and V update are
/// bit for bit those of the same values converted first (the prefill tile's path).
#[cfg(target_arch = "x86_64")]
#[test]
fn reading_f16_directly_gives_the_converted_path_bits() {
    use half::f16;
    if !crate::cpu::Kernels::available()
        .iter()
        .any(|k| k.level() >= crate::cpu::Level::Avx2)
    {
        return;
    }
    let mut next = noise(0x5eed_0f16_0000_0001);
    for hd in [64, 60, 128] {
        for n in [1, 7, 16, 32] {
            let q: Vec<f32> = (0..hd).map(|_| next()).collect();
            let kh: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(next())).collect();
            let k: Vec<f32> = kh.iter().map(|h| h.to_f32()).collect();
            let (mut direct, mut converted) = ([0.0f32; 32], [0.0f32; 32]);
            // SAFETY: the CPU has AVX2 (checked above), which implies F16C in `Kernels`.
            #[allow(unsafe_code)]
            unsafe {
                super::avx2::scores8(&q, &kh, n, &mut direct)
            };
            scores_rows::<false>(&q, &k, n, &mut converted);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&direct[..n]), bits(&converted[..n]), "hd {hd} n {n}");
            let p: Vec<f32> = (0..n).map(|_| next().abs() / 4.0).collect();
            let start: Vec<f32> = (0..hd).map(|_| next()).collect();
            let (mut a, mut b) = (start.clone(), start);
            // SAFETY: as above.
            #[allow(unsafe_code)]
            unsafe {
                super::avx2::accumulate(&mut a, &p, &kh, hd)
            };
            accumulate(&mut b, &p, &k, hd);
            assert_eq!(bits(&a), bits(&b), "hd {hd} n {n}");
        }
    }
}

/// The softmax's exponential is within two ulps of libm's over its whole range, exactly
/// 1 at 0, and 0 at minus infinity and below where e^x is subnormal.
#[test]
fn the_softmax_exponential_tracks_libm() {
    let mut worst = 0u32;
    let mut x = 0.0f32;
    while x > -87.0 {
        let (got, want) = (exp_neg(x), x.exp());
        let ulps = got.to_bits().abs_diff(want.to_bits());
        worst = worst.max(ulps);
        assert!(ulps <= 2, "exp({x}) = {got}, libm {want}");
        x -= 0.000_731;
    }
    assert_eq!(exp_neg(0.0), 1.0);
    assert_eq!(exp_neg(-0.0), 1.0);
    assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_neg(-100.0), 0.0);
    assert!(worst <= 2);
}

/// A transposed page's scores are [`dot_f32`]'s, bit for bit: a prefill tile and a decode
/// step give a position the same logits.
#[test]
fn transposed_scores_equal_the_decode_dot_products_bit_for_bit() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
    };
    for hd in [64, 60, 128] {
        for _ in 0..50 {
            let q: Vec<f32> = (0..hd).map(|_| next()).collect();
            let k: Vec<f32> = (0..32 * hd).map(|_| next()).collect();
            let mut kt = vec![0.0f32; 32 * hd];
            for s in 0..32 {
                for d in 0..hd {
                    kt[d * 32 + s] = k[s * hd + d];
                }
            }
            let mut got = [0.0f32; 32];
            scores_t::<32>(&q, &kt, &mut got);
            for s in 0..32 {
                let want = dot_f32(&q, &k[s * hd..(s + 1) * hd]);
                assert_eq!(got[s].to_bits(), want.to_bits(), "hd {hd} slot {s}");
            }
        }
    }
}
