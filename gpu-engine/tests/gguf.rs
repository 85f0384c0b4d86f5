//! GGUF reader and dequantisation: a synthetic file written here (every metadata type, every
//! tensor type), hand-computed dequantisation blocks, mutation fuzzing (never a panic), and the
//! real SmolLM2 test model when it has been fetched (`scripts/fetch-model.sh`).

mod common;

use lockstep_engine::gguf::{Gguf, GgufError, Value};
use lockstep_engine::quant::{TensorType, dequantize};
use proptest::prelude::*;

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// A small valid GGUF v3 file: metadata of several types, and one tensor of each type.
/// (name, type, data bytes, element count) of one synthetic tensor.
type Tensor = (String, TensorType, Vec<u8>, u64);

fn synthetic(version: u32) -> (Vec<u8>, Vec<Tensor>) {
    let tensors: Vec<Tensor> = vec![
        (
            "f32".into(),
            TensorType::F32,
            [1.5f32, -2.0, 0.25, 8.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            4,
        ),
        (
            "f16".into(),
            TensorType::F16,
            [1.5f32, -2.0]
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            2,
        ),
        ("q4_0".into(), TensorType::Q4_0, q4_0_block(), 32),
        ("q4_1".into(), TensorType::Q4_1, q4_1_block(), 32),
        ("q8_0".into(), TensorType::Q8_0, q8_0_block(), 32),
    ];
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    put_str(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    put_str(&mut b, "llama");
    put_str(&mut b, "llama.context_length");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&8192u32.to_le_bytes());
    put_str(&mut b, "llama.rope.freq_base");
    b.extend_from_slice(&6u32.to_le_bytes());
    b.extend_from_slice(&10000.0f32.to_le_bytes());
    put_str(&mut b, "tokenizer.ggml.tokens");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    put_str(&mut b, "<s>");
    put_str(&mut b, "hi");
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, ty, data, n) in &tensors {
        put_str(&mut b, name);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(&ty.id().to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + data.len() as u64).div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    let start = b.len();
    for ((_, _, data, _), off) in tensors.iter().zip(&offsets) {
        b.resize(start + *off as usize, 0);
        b.extend_from_slice(data);
    }
    (b, tensors)
}

fn f16b(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// d = 0.5; byte j holds low nibble j % 16 and high nibble 15 - j % 16.
fn q4_0_block() -> Vec<u8> {
    let mut b = f16b(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    b
}
fn q4_1_block() -> Vec<u8> {
    let mut b = f16b(0.25).to_vec();
    b.extend_from_slice(&f16b(-1.0));
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    b
}
fn q8_0_block() -> Vec<u8> {
    let mut b = f16b(0.125).to_vec();
    b.extend((0..32i32).map(|j| ((j - 16) * 4) as i8 as u8));
    b
}

#[test]
fn dequantisation_matches_hand_computed_blocks() {
    let mut out = vec![0.0f32; 32];
    dequantize(TensorType::Q4_0, &q4_0_block(), &mut out).expect("q4_0");
    // Element j < 16: (j - 8) * 0.5; element 16 + j: (15 - j - 8) * 0.5.
    assert_eq!(out[0], -4.0);
    assert_eq!(out[8], 0.0);
    assert_eq!(out[15], 3.5);
    assert_eq!(out[16], 3.5);
    assert_eq!(out[31], -4.0);
    dequantize(TensorType::Q4_1, &q4_1_block(), &mut out).expect("q4_1");
    assert_eq!(out[0], -1.0);
    assert_eq!(out[15], 2.75);
    assert_eq!(out[16], 2.75);
    assert_eq!(out[31], -1.0);
    dequantize(TensorType::Q8_0, &q8_0_block(), &mut out).expect("q8_0");
    assert_eq!(out[0], -8.0);
    assert_eq!(out[16], 0.0);
    assert_eq!(out[31], 7.5);
    let mut two = [0.0f32; 2];
    dequantize(TensorType::Bf16, &[0x80, 0x3f, 0x00, 0xc0], &mut two).expect("bf16");
    assert_eq!(two, [1.0, -2.0]);
    // A byte count that does not match the element count is refused.
    assert!(dequantize(TensorType::Q4_0, &q4_0_block()[..17], &mut out).is_err());
    assert!(dequantize(TensorType::Q8_0, &q8_0_block(), &mut out[..31]).is_err());
}

#[test]
fn synthetic_file_parses_in_both_versions() {
    for version in [2, 3] {
        let (bytes, tensors) = synthetic(version);
        let g = Gguf::parse(&bytes[..]).expect("parses");
        assert_eq!(g.version, version);
        assert_eq!(
            g.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        assert_eq!(
            g.get("llama.context_length").and_then(Value::as_u64),
            Some(8192)
        );
        assert_eq!(
            g.get("llama.rope.freq_base").and_then(Value::as_f64),
            Some(10000.0)
        );
        assert_eq!(
            g.get("tokenizer.ggml.tokens"),
            Some(&Value::Array(vec![
                Value::Str("<s>".into()),
                Value::Str("hi".into())
            ]))
        );
        assert_eq!(g.alignment, 32);
        assert_eq!(g.tensors.len(), tensors.len());
        for (name, ty, data, n) in &tensors {
            let t = g.tensor(name).expect("tensor");
            assert_eq!((t.ty, t.elements()), (*ty, *n));
            assert_eq!(g.tensor_data(t), &data[..], "{name}");
        }
        let f = g.tensor("f32").expect("f32");
        let mut out = vec![0.0; 4];
        dequantize(f.ty, g.tensor_data(f), &mut out).expect("f32");
        assert_eq!(out, [1.5, -2.0, 0.25, 8.0]);
    }
}

#[test]
fn malformed_files_get_precise_errors() {
    let (good, _) = synthetic(3);
    assert!(matches!(
        Gguf::parse(&b"GGML\x03\0\0\0"[..]),
        Err(GgufError::BadMagic(_))
    ));
    let mut v9 = good.clone();
    v9[4] = 9;
    assert!(matches!(
        Gguf::parse(&v9[..]),
        Err(GgufError::UnsupportedVersion(9))
    ));
    assert!(matches!(
        Gguf::parse(&good[..good.len() - 1]),
        Err(GgufError::BadTensorData { .. })
    ));
    assert!(matches!(
        Gguf::parse(&good[..40]),
        Err(GgufError::Truncated { .. })
    ));
    // A tensor count far beyond the file is refused before any allocation.
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        Gguf::parse(&huge[..]),
        Err(GgufError::Truncated { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    /// Random byte flips, truncations and insertions never panic.
    #[test]
    fn mutated_files_never_panic(edits in proptest::collection::vec((0usize..4096, any::<u8>(), 0u8..3), 1..8), cut in proptest::option::of(0usize..4096)) {
        let (mut b, _) = synthetic(3);
        for (pos, byte, kind) in edits {
            let pos = pos % b.len();
            match kind {
                0 => b[pos] = byte,
                1 => b.insert(pos, byte),
                _ => { b.remove(pos); }
            }
        }
        if let Some(c) = cut {
            b.truncate(c % (b.len() + 1));
        }
        if let Ok(g) = Gguf::parse(&b[..]) {
            for t in &g.tensors {
                let data = g.tensor_data(t);
                let mut out = vec![0.0f32; t.elements().min(1 << 16) as usize];
                if out.len() as u64 == t.elements() {
                    prop_assert!(dequantize(t.ty, data, &mut out).is_ok());
                }
            }
        }
    }
}

/// The real test model, when fetched: every tensor type is known and readable.
#[test]
fn smollm2_test_model_reads_when_present() {
    let Some(path) = common::model_path() else {
        return;
    };
    let g = lockstep_engine::gguf::open(&path).expect("opens");
    assert_eq!(g.version, 3);
    assert_eq!(
        g.get("general.architecture").and_then(Value::as_str),
        Some("llama")
    );
    assert_eq!(g.tensors.len(), 272);
    let mut kinds = std::collections::BTreeSet::new();
    for t in &g.tensors {
        kinds.insert(format!("{:?}", t.ty));
    }
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        ["F32", "Q4_1", "Q8_0"]
    );
    let emb = g.tensor("token_embd.weight").expect("embeddings");
    assert_eq!(emb.dims, [576, 49152]);
    let row = &g.tensor_data(emb)[..576 / 32 * 34];
    let mut out = vec![0.0f32; 576];
    dequantize(emb.ty, row, &mut out).expect("row");
    assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|x| *x != 0.0));
}
