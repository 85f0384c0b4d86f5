//! GGUF reader (versions 2 and 3): header, metadata, tensor index, alignment, and tensor data
//! borrowed from a read-only memory map. Every length and count is checked against the bytes that
//! remain, so a truncated or malformed file is an error, never a panic or a huge allocation.

use std::collections::BTreeMap;
use std::path::Path;

use crate::quant::TensorType;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// uint8..uint64 (widened).
    U64(u64),
    /// int8..int64 (widened).
    I64(i64),
    /// float32 / float64 (widened).
    F64(f64),
    /// bool.
    Bool(bool),
    /// string.
    Str(String),
    /// array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
    /// The value as a float, when it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (GGUF order).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: TensorType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    /// Byte size of the tensor's data.
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Why a file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        message: String,
    },
    /// Not a GGUF file.
    #[error("not a GGUF file (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A version this reader does not know.
    #[error("unsupported GGUF version {0} (2 and 3 are supported)")]
    UnsupportedVersion(u32),
    /// The file ends before a field it declares.
    #[error("truncated at byte {at}: {what} needs {needed} more bytes, {left} left")]
    Truncated {
        /// Offset of the field.
        at: usize,
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes left.
        left: usize,
    },
    /// An unknown metadata value type.
    #[error("unknown metadata value type {0} at byte {1}")]
    BadValueType(u32, usize),
    /// A string that is not UTF-8.
    #[error("string at byte {0} is not UTF-8")]
    BadUtf8(usize),
    /// Nesting deeper than this reader accepts.
    #[error("metadata arrays nested too deeply at byte {0}")]
    TooDeep(usize),
    /// A tensor declares more dimensions than GGML allows.
    #[error("tensor `{name}` has {dims} dimensions (at most 4)")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Its declared dimension count.
        dims: u32,
    },
    /// An unknown tensor type.
    #[error("tensor `{name}` has unknown type {ty}")]
    UnknownTensorType {
        /// The tensor.
        name: String,
        /// The type id.
        ty: u32,
    },
    /// A tensor whose element count does not fit its type's blocks, or overflows.
    #[error("tensor `{name}` has an invalid shape {dims:?} for its type")]
    BadShape {
        /// The tensor.
        name: String,
        /// Its dims.
        dims: Vec<u64>,
    },
    /// Tensor data outside the file or not aligned.
    #[error(
        "tensor `{name}` data at offset {offset} (+{size} bytes) is outside the file or misaligned"
    )]
    BadTensorData {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// Its size.
        size: u64,
    },
    /// Two tensors with one name.
    #[error("duplicate tensor `{0}`")]
    DuplicateTensor(String),
    /// A bad `general.alignment`.
    #[error("invalid general.alignment {0}")]
    BadAlignment(u64),
}

/// A parsed GGUF file over some bytes (a memory map or a buffer).
#[derive(Debug)]
pub struct Gguf<B: AsRef<[u8]>> {
    bytes: B,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of tensor data.
    pub alignment: u64,
    data_start: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let left = self.b.len() - self.pos;
        if n > left as u64 {
            return Err(GgufError::Truncated {
                at: self.pos,
                what,
                needed: n,
                left,
            });
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::BadUtf8(at))
    }
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        let at = self.pos;
        Ok(match ty {
            0 => Value::U64(self.arr::<1>("u8")?[0] as u64),
            1 => Value::I64(self.arr::<1>("i8")?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.arr("u16")?) as u64),
            3 => Value::I64(i16::from_le_bytes(self.arr("i16")?) as i64),
            4 => Value::U64(self.u32("u32")? as u64),
            5 => Value::I64(i32::from_le_bytes(self.arr("i32")?) as i64),
            6 => Value::F64(f32::from_le_bytes(self.arr("f32")?) as f64),
            7 => Value::Bool(self.arr::<1>("bool")?[0] != 0),
            8 => Value::Str(self.string("string")?),
            9 => {
                if depth > 2 {
                    return Err(GgufError::TooDeep(at));
                }
                let inner = self.u32("array type")?;
                let n = self.u64("array length")?;
                // Every element takes at least one byte: a count beyond the bytes left is a lie.
                if n > self.left() as u64 {
                    return Err(GgufError::Truncated {
                        at,
                        what: "array",
                        needed: n,
                        left: self.left(),
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(inner, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64("u64")?),
            11 => Value::I64(i64::from_le_bytes(self.arr("i64")?)),
            12 => Value::F64(f64::from_le_bytes(self.arr("f64")?)),
            other => return Err(GgufError::BadValueType(other, at)),
        })
    }
}

impl<B: AsRef<[u8]>> Gguf<B> {
    /// Parses `bytes` as a GGUF file.
    pub fn parse(bytes: B) -> Result<Gguf<B>, GgufError> {
        let b = bytes.as_ref();
        let mut c = Cursor { b, pos: 0 };
        let magic = c.arr::<4>("magic")?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // Each entry takes at least 8 bytes: bound the counts by the file before looping.
        if n_kv.saturating_add(n_tensors) > (c.left() / 8) as u64 {
            return Err(GgufError::Truncated {
                at: c.pos,
                what: "metadata and tensor index",
                needed: n_kv.saturating_add(n_tensors).saturating_mul(8),
                left: c.left(),
            });
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => return Err(GgufError::BadAlignment(v.as_u64().unwrap_or(0))),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor dims")?;
            if n_dims > 4 {
                return Err(GgufError::TooManyDims { name, dims: n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dim")?);
            }
            let ty_id = c.u32("tensor type")?;
            let ty = TensorType::from_id(ty_id).ok_or(GgufError::UnknownTensorType {
                name: name.clone(),
                ty: ty_id,
            })?;
            let offset = c.u64("tensor offset")?;
            let elements = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            let size =
                elements
                    .and_then(|n| ty.bytes_for(n))
                    .ok_or_else(|| GgufError::BadShape {
                        name: name.clone(),
                        dims: dims.clone(),
                    })?;
            if !names.insert(name.clone()) {
                return Err(GgufError::DuplicateTensor(name));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                size,
            });
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (b.len() as u64).saturating_sub(data_start);
        for t in &tensors {
            let end = t.offset.checked_add(t.size);
            if !t.offset.is_multiple_of(alignment) || end.is_none_or(|e| e > data_len) {
                return Err(GgufError::BadTensorData {
                    name: t.name.clone(),
                    offset: t.offset,
                    size: t.size,
                });
            }
        }
        Ok(Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_start: data_start as usize,
            bytes,
        })
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's raw bytes (bounds were checked at parse time).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.data_start + t.offset as usize;
        &self.bytes.as_ref()[start..start + t.size as usize]
    }

    /// What holds the file's bytes (a map, or a buffer).
    pub fn backing(&self) -> &B {
        &self.bytes
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
}

/// A GGUF file's bytes: mapped, or read into memory (what a caller that verifies the bytes
/// it loads uses, so nothing can change them between the check and the load).
#[derive(Debug)]
pub enum FileBytes {
    /// A read-only memory map.
    Mapped(memmap2::Mmap),
    /// Read once into memory.
    Read(Vec<u8>),
}

impl AsRef<[u8]> for FileBytes {
    fn as_ref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Read(v) => v,
        }
    }
}

/// Opens a GGUF file through a read-only memory map.
pub fn open(path: &Path) -> Result<Gguf<FileBytes>, GgufError> {
    let io = |e: std::io::Error| GgufError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and private to this process. Like every mmap-based model
    // loader (llama.cpp, candle), we require that the file is not truncated or rewritten while
    // mapped; model files are immutable artifacts, verified by hash when fetched.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Gguf::parse(FileBytes::Mapped(map))
}
