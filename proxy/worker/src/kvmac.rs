//! The per-pair KV MAC: the router draws a fresh 32-byte key for each pair and gives it to both
//! of the pair's workers; the prefill worker signs the manifest it pushes (HMAC-SHA256), the
//! decode worker imports only a set whose MAC verifies under the key its own `Decode` call
//! carries. The manifest binds the pair, the model, the token count, the layout and every page's
//! checksum, so a set forged by anyone without the key, or replayed from another pair, is
//! refused before it touches the pool. (The page checksums are xxh3: they catch corruption; on
//! the wire, TLS is what stops an on-path attacker from rewriting pages: `docs/SECURITY.md`.)

use hmac::{Hmac, Mac};
use lockstep_engine::transfer::KvManifest;
use sha2::Sha256;
use tonic::Status;

/// Bytes in a pair's KV key and in a MAC.
pub const KEY_BYTES: usize = 32;

/// A pair's KV key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KvKey([u8; KEY_BYTES]);

impl std::fmt::Debug for KvKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvKey(***)")
    }
}

/// A manifest's MAC.
pub type Tag = [u8; KEY_BYTES];

impl KvKey {
    /// The key a request carries: exactly 32 bytes (anything else is refused, never ignored).
    pub fn from_request(bytes: &[u8]) -> Result<KvKey, Status> {
        <[u8; KEY_BYTES]>::try_from(bytes).map(KvKey).map_err(|_| {
            Status::invalid_argument(format!(
                "kv_key must be the pair's {KEY_BYTES}-byte key from the router (got {} bytes)",
                bytes.len()
            ))
        })
    }

    fn mac(&self, m: &KvManifest) -> Hmac<Sha256> {
        let mut h = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key");
        h.update(b"lockstep kv manifest v1\0");
        h.update(&m.pair_id.to_le_bytes());
        h.update(&m.model.0.to_le_bytes());
        h.update(&m.tokens.to_le_bytes());
        h.update(&m.page_size.to_le_bytes());
        h.update(&[m.dtype as u8]);
        h.update(&m.page_count.to_le_bytes());
        h.update(&(m.page_checksums.len() as u64).to_le_bytes());
        for c in &m.page_checksums {
            h.update(&c.to_le_bytes());
        }
        h.update(&m.manifest_checksum.to_le_bytes());
        h
    }

    /// The manifest's MAC under this key.
    pub fn sign(&self, m: &KvManifest) -> Tag {
        self.mac(m).finalize().into_bytes().into()
    }

    /// Whether `tag` is the manifest's MAC under this key (constant-time comparison).
    pub fn verifies(&self, m: &KvManifest, tag: &[u8]) -> bool {
        self.mac(m).verify_slice(tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_engine::pool::KvDtype;
    use lockstep_engine::transfer::ModelFingerprint;

    fn manifest() -> KvManifest {
        let mut m = KvManifest {
            pair_id: 9,
            model: ModelFingerprint(3),
            tokens: 20,
            page_size: 16,
            dtype: KvDtype::F16,
            page_count: 2,
            page_checksums: vec![11, 12],
            manifest_checksum: 0,
        };
        m.manifest_checksum = m.compute_checksum();
        m
    }

    #[test]
    fn a_mac_binds_the_key_and_every_manifest_field() {
        let k = KvKey([1; 32]);
        let m = manifest();
        let tag = k.sign(&m);
        assert!(k.verifies(&m, &tag));
        assert!(!KvKey([2; 32]).verifies(&m, &tag), "another pair's key");
        assert!(!k.verifies(&m, &tag[..31]), "a truncated tag");
        let changes: [fn(&mut KvManifest); 7] = [
            |m| m.pair_id += 1,
            |m| m.model.0 += 1,
            |m| m.tokens += 1,
            |m| m.page_size *= 2,
            |m| m.dtype = KvDtype::F32,
            |m| m.page_checksums[1] ^= 1,
            |m| m.manifest_checksum ^= 1,
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut other = m.clone();
            change(&mut other);
            assert!(!k.verifies(&other, &tag), "change {i} went unnoticed");
        }
    }

    #[test]
    fn a_key_must_be_exactly_32_bytes() {
        assert!(KvKey::from_request(&[7; 32]).is_ok());
        for n in [0, 16, 31, 33] {
            let e = KvKey::from_request(&vec![7; n]).expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
        }
    }
}
