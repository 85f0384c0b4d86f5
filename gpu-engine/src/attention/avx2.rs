//! A decode step's scores and V update with AVX2, over K/V as stored (f32 or f16).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

/// A stored KV element: f32, or f16 converted in registers (exactly, as the scratch path's
/// bulk conversion converts it).
pub(super) trait Elem: Copy {
    /// Eight elements from `p` as f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable; the CPU must have AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;
    fn f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        // SAFETY: the caller's.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// `out[d] += Σ_s p[s] × v[s × hd + d]` as [`super::accumulate`] adds it (each element's
/// terms in slot order), reading V as stored: 32 dimensions at a time in four registers.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate<T: Elem>(out: &mut [f32], p: &[f32], v: &[T], hd: usize) {
    assert!(out.len() >= hd && v.len() >= p.len() * hd);
    let wide = hd / 32 * 32;
    for c in (0..wide).step_by(32) {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c + 32 <= hd <= out.len()`.
            *a = unsafe { _mm256_loadu_ps(out.as_ptr().add(c + 8 * i)) };
        }
        for (s, &ps) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(ps);
            let row = v[s * hd..].as_ptr();
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: `s × hd + c + 8i + 8 <= (s + 1) × hd <= v.len()`.
                let x = unsafe { T::load8(row.add(c + 8 * i)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, x));
            }
        }
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: as the loads.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * i), *a) };
        }
    }
    for (s, &ps) in p.iter().enumerate() {
        for (o, x) in out[wide..hd]
            .iter_mut()
            .zip(&v[s * hd + wide..(s + 1) * hd])
        {
            *o += ps * x.f32();
        }
    }
}

/// [`super::scores_rows`] eight rows at a time: per row the eight running sums of
/// [`crate::matmul::dot_f32`] (element `d` into sum `d mod 8`, a multiply then an add, in
/// order), then their sum in lane order from `-0.0` (as `Iterator::sum` folds), for eight
/// rows at once, then the remainder dimensions in order.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores8<T: Elem>(q: &[f32], k: &[T], n: usize, scores: &mut [f32; 32]) {
    let hd = q.len();
    let whole = hd / 8 * 8;
    assert!(n <= 32 && k.len() >= n * hd);
    let mut s0 = 0;
    while s0 < n {
        // Rows past `n` repeat the last one; their sums are not kept.
        let mut rows: [&[T]; 8] = [&k[..hd]; 8];
        for (j, row) in rows.iter_mut().enumerate() {
            let r = (s0 + j).min(n - 1);
            *row = &k[r * hd..(r + 1) * hd];
        }
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..whole).step_by(8) {
            // SAFETY: `c + 8 <= whole <= hd`, the length of `q` and of every row.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
            for j in 0..8 {
                // SAFETY: as above.
                let kv = unsafe { T::load8(rows[j].as_ptr().add(c)) };
                acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(qv, kv));
            }
        }
        // Transpose: `t[i]` holds lane `i` of every row's sums.
        let a01l = _mm256_unpacklo_ps(acc[0], acc[1]);
        let a01h = _mm256_unpackhi_ps(acc[0], acc[1]);
        let a23l = _mm256_unpacklo_ps(acc[2], acc[3]);
        let a23h = _mm256_unpackhi_ps(acc[2], acc[3]);
        let a45l = _mm256_unpacklo_ps(acc[4], acc[5]);
        let a45h = _mm256_unpackhi_ps(acc[4], acc[5]);
        let a67l = _mm256_unpacklo_ps(acc[6], acc[7]);
        let a67h = _mm256_unpackhi_ps(acc[6], acc[7]);
        let b0 = _mm256_shuffle_ps::<0x44>(a01l, a23l);
        let b1 = _mm256_shuffle_ps::<0xee>(a01l, a23l);
        let b2 = _mm256_shuffle_ps::<0x44>(a01h, a23h);
        let b3 = _mm256_shuffle_ps::<0xee>(a01h, a23h);
        let b4 = _mm256_shuffle_ps::<0x44>(a45l, a67l);
        let b5 = _mm256_shuffle_ps::<0xee>(a45l, a67l);
        let b6 = _mm256_shuffle_ps::<0x44>(a45h, a67h);
        let b7 = _mm256_shuffle_ps::<0xee>(a45h, a67h);
        let t = [
            _mm256_permute2f128_ps::<0x20>(b0, b4),
            _mm256_permute2f128_ps::<0x20>(b1, b5),
            _mm256_permute2f128_ps::<0x20>(b2, b6),
            _mm256_permute2f128_ps::<0x20>(b3, b7),
            _mm256_permute2f128_ps::<0x31>(b0, b4),
            _mm256_permute2f128_ps::<0x31>(b1, b5),
            _mm256_permute2f128_ps::<0x31>(b2, b6),
            _mm256_permute2f128_ps::<0x31>(b3, b7),
        ];
        let mut sum = _mm256_set1_ps(-0.0);
        for ti in t {
            sum = _mm256_add_ps(sum, ti);
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` is eight f32; an unaligned store.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        for (j, o) in out.iter_mut().enumerate() {
            for d in whole..hd {
                *o += q[d] * rows[j][d].f32();
            }
        }
        let m = (n - s0).min(8);
        scores[s0..s0 + m].copy_from_slice(&out[..m]);
        s0 += 8;
    }
}
