//! Scalar arithmetic of the attention kernels, written so the compiler vectorises it.

/// `e^x` for `x <= 0` (softmax terms: a score less the running maximum), within two ulps of
/// libm's, `0` below `-87` and at `-inf`. Branch-free and built from plain f32
/// arithmetic (Cody-Waite reduction and Cephes' degree-5 polynomial, without fused
/// multiply-adds), so a loop over a page's scores vectorises, and the result is the same bit
/// for bit in every kernel set and whichever path (prefill tile or decode step) computes it.
#[inline(always)]
pub(super) fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest (even) by the float adder: |x × log2 e| < 2^22 after the clamp.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 0.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // 2^n for n in -126..=0, by the exponent bits.
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.0 { 0.0 } else { e * scale }
}

/// `out[d] += Σ_s p[s] × v[s × hd + d]`, each element's terms added in slot order (as a loop
/// over slots then dimensions would add them, so bit for bit the same), 32 dimensions at a
/// time: their sums stay in registers across the page's slots instead of going through memory
/// once per slot.
#[inline(always)]
pub(super) fn accumulate(out: &mut [f32], p: &[f32], v: &[f32], hd: usize) {
    let wide = hd / 32 * 32;
    for c in (0..wide).step_by(32) {
        let mut acc = [0.0f32; 32];
        acc.copy_from_slice(&out[c..c + 32]);
        for (s, &ps) in p.iter().enumerate() {
            let row = &v[s * hd + c..s * hd + c + 32];
            for i in 0..32 {
                acc[i] += ps * row[i];
            }
        }
        out[c..c + 32].copy_from_slice(&acc);
    }
    for (s, &ps) in p.iter().enumerate() {
        for (o, x) in out[wide..].iter_mut().zip(&v[s * hd + wide..(s + 1) * hd]) {
            *o += ps * x;
        }
    }
}
