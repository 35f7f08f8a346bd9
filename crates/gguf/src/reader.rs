//! The GGUF reader: maps a file, parses its header, metadata and tensor infos, and checks that
//! every tensor lies inside the file, so that later reads of tensor data cannot fail.
//!
//! The layout (little-endian; GGUF v2 and v3 differ from v1 in using u64 counts and lengths):
//!
//! ```text
//! "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string | value_type u32 | value)          string = len u64 | UTF-8 bytes
//! tensor_count × (name: string | n_dims u32 | dims u64 × n_dims | ggml_type u32 | offset u64)
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset, dims[0] the fastest-varying
//! ```
//!
//! Every read goes through [`Cursor`], which checks the length first and names what it was
//! reading, so a truncated or corrupt file is an error naming the file, the field and the offset,
//! never a panic or an allocation sized by garbage.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::dequant::Dequantizer;
use crate::error::GgufError;
use crate::types::GgmlType;
use crate::value::{type_name, Value};

/// The alignment of tensor data when the file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml's limit on a tensor's dimensions.
const MAX_DIMS: u32 = 4;

/// Arrays may nest; a file that nests them deeper than this is taken as corrupt (a real file
/// nests at most once), so that a crafted file cannot exhaust the stack.
const MAX_ARRAY_DEPTH: usize = 4;

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its name ("blk.0.attn_q.weight").
    pub name: String,
    /// Its dimensions in ggml's order: `dims[0]` varies fastest (the reverse of PyTorch's shape).
    pub dims: Vec<u64>,
    /// Its element type.
    pub ty: GgmlType,
    /// Where its data starts, relative to the start of the data section.
    pub offset: u64,
    /// Its size in bytes, when its type's block layout is known.
    pub n_bytes: Option<u64>,
    /// Where its entry starts in the file (for error messages).
    pub info_offset: u64,
}

impl TensorInfo {
    /// The number of elements (the product of the dimensions).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape as PyTorch and safetensors write it: the dimensions reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open GGUF file: its metadata and tensor infos parsed, its data mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens and maps `path`, parses its header and checks every tensor's extent.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(GgufError::io("open", &path))?;
        // SAFETY: the map is read-only and private to this process, and every slice taken from
        // it is bounds-checked against its length. A file truncated or rewritten by another
        // process while mapped is outside what this type promises (as for any mmap reader).
        let map = unsafe { Mmap::map(&file) }.map_err(GgufError::io("mmap", &path))?;
        let header = parse(&map, &path)?;
        Ok(GgufFile {
            path,
            map,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Every tensor's entry, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The entry of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's raw bytes, as stored (quantised or not).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8], GgufError> {
        let unsupported = || GgufError::UnsupportedType {
            path: self.path.clone(),
            tensor: info.name.clone(),
            ty: info.ty.to_string(),
        };
        let n = info.n_bytes.ok_or_else(unsupported)?;
        // `open` checked the extent of every tensor of the file; this check is for an info
        // made or changed by the caller.
        let start = self.data_offset.saturating_add(info.offset);
        let range = usize::try_from(start)
            .ok()
            .zip(usize::try_from(start.saturating_add(n)).ok());
        range
            .and_then(|(a, b)| self.map.get(a..b))
            .ok_or_else(|| GgufError::Truncated {
                path: self.path.clone(),
                what: format!("the data of tensor {}", info.name),
                offset: start,
                need: n,
                len: self.map.len() as u64,
            })
    }

    /// The function that turns this tensor's bytes into f32, or the error naming the tensor
    /// and its type when there is none.
    pub fn dequantizer(&self, info: &TensorInfo) -> Result<Dequantizer, GgufError> {
        Dequantizer::for_type(info.ty).ok_or_else(|| GgufError::UnsupportedType {
            path: self.path.clone(),
            tensor: info.name.clone(),
            ty: info.ty.to_string(),
        })
    }

    /// A tensor's values as f32, in the file's order (`dims[0]` fastest).
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let kernel = self.dequantizer(info)?;
        let bytes = self.tensor_bytes(info)?;
        let mut out = vec![0f32; info.n_elements() as usize];
        kernel.run(bytes, &mut out);
        Ok(out)
    }

    fn key<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        get: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => get(v).map(Some).ok_or_else(|| GgufError::WrongKey {
                path: self.path.clone(),
                key: key.to_string(),
                expected: expected.to_string(),
                found: v.describe(),
            }),
        }
    }

    fn required<T>(&self, key: &str, v: Option<T>) -> Result<T, GgufError> {
        v.ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    /// Key `key` as a non-negative integer of any width, if present.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.key(key, "a non-negative integer", Value::as_u64)
    }

    /// Key `key` as a non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.opt_u64(key)?;
        self.required(key, v)
    }

    /// Key `key` as a float of either width, if present.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.key(key, "a float", Value::as_f64)
    }

    /// Key `key` as a boolean, if present.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.key(key, "a BOOL", Value::as_bool)
    }

    /// Key `key` as a string, if present.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.key(key, "a STRING", Value::as_str)
    }

    /// Key `key` as a string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.opt_str(key)?;
        self.required(key, v)
    }

    /// Key `key` as an array of strings, if present.
    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.key(key, "an ARRAY of STRING", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }

    /// Key `key` as an array of integers, if present.
    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        self.key(key, "an ARRAY of integers", |v| {
            v.as_array()?.iter().map(Value::as_i64).collect()
        })
    }
}

/// What `parse` reads before the data section.
struct Header {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

fn parse(buf: &[u8], path: &Path) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0, path };
    if buf.len() < 4 || &buf[..4] != b"GGUF" {
        return Err(GgufError::NotGguf {
            path: path.to_path_buf(),
            found: buf[..buf.len().min(4)].to_vec(),
        });
    }
    c.pos = 4;
    let version = c.u32(|| "the version".into())?;
    if version != 2 && version != 3 {
        // A big-endian file's version reads as 0x0N000000 here.
        let hint = if version & 0xffff == 0 && version != 0 {
            "; the file looks big-endian, which is not supported"
        } else {
            ""
        };
        return Err(GgufError::Version {
            path: path.to_path_buf(),
            version,
            hint,
        });
    }
    let n_tensors = c.u64(|| "the tensor count".into())?;
    let n_kv = c.u64(|| "the metadata count".into())?;

    // Capacities are bounded by what the rest of the file could hold, so that a corrupt count
    // fails at its first missing entry instead of allocating.
    let mut metadata = Vec::with_capacity(c.fits(n_kv, 8 + 4 + 1));
    let mut keys = HashSet::new();
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.string(|| format!("the key of metadata entry {i}"))?;
        let ty = c.u32(|| format!("the value type of metadata key {key}"))?;
        let value = c.value(ty, 0, &|| format!("metadata key {key}"))?;
        if !keys.insert(key.clone()) {
            return Err(c.corrupt(format!("metadata key {key}"), at, "the key appears twice"));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 => a,
            _ => {
                return Err(GgufError::WrongKey {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    expected: "a positive integer".into(),
                    found: format!("{v:?}"),
                })
            }
        },
    };

    let mut tensors = Vec::with_capacity(c.fits(n_tensors, 8 + 4 + 4 + 8));
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let info_offset = c.pos as u64;
        let name = c.string(|| format!("the name of tensor info {i}"))?;
        let n_dims = c.u32(|| format!("the dimension count of tensor {name}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.corrupt(
                format!("tensor {name}"),
                info_offset as usize,
                format!("{n_dims} dimensions (1 to {MAX_DIMS} expected)"),
            ));
        }
        let dims = (0..n_dims)
            .map(|d| c.u64(|| format!("dimension {d} of tensor {name}")))
            .collect::<Result<Vec<_>, _>>()?;
        let ty = GgmlType(c.u32(|| format!("the type of tensor {name}"))?);
        let offset = c.u64(|| format!("the data offset of tensor {name}"))?;
        let bad =
            |reason: String| c.corrupt(format!("tensor {name}"), info_offset as usize, reason);
        if !names.insert(name.clone()) {
            return Err(bad("the name appears twice".into()));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
        if offset % alignment != 0 {
            return Err(bad(format!(
                "data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let n_bytes = match ty.block() {
            None => None,
            Some((block, block_bytes)) => {
                if dims[0] % block != 0 {
                    return Err(bad(format!(
                        "its first dimension {} is not a multiple of {ty}'s block of {block}",
                        dims[0]
                    )));
                }
                Some(n_elements / block * block_bytes)
            }
        };
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_bytes,
            info_offset,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let len = buf.len() as u64;
    for t in &tensors {
        let Some(n) = t.n_bytes else { continue };
        let start = data_offset.checked_add(t.offset);
        if start
            .and_then(|s| s.checked_add(n))
            .is_none_or(|end| end > len)
        {
            return Err(GgufError::Truncated {
                path: path.to_path_buf(),
                what: format!("the data of tensor {} ({} {:?})", t.name, t.ty, t.dims),
                offset: start.unwrap_or(u64::MAX),
                need: n,
                len,
            });
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// A position in the mapped file; every read checks the length first.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    /// `n` bytes from the current position, or the error naming `what` (built only on failure).
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let bytes = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(bytes)
    }

    fn array<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// How many of `count` items of at least `min_size` bytes the rest of the file can hold.
    fn fits(&self, count: u64, min_size: u64) -> usize {
        count.min((self.buf.len() - self.pos) as u64 / min_size) as usize
    }

    fn corrupt(&self, what: String, at: usize, reason: impl Into<String>) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            what,
            offset: at as u64,
            reason: reason.into(),
        }
    }

    fn string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.u64(|| format!("the length of {}", what()))?;
        let bytes = self.take(n, || format!("{} ({n} bytes of text)", what()))?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.corrupt(what(), at, format!("not UTF-8 ({e})")))
    }

    /// A value of type `ty`; `what` names the key (and, inside arrays, the element).
    fn value(
        &mut self,
        ty: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Value, GgufError> {
        macro_rules! le {
            ($t:ty, $variant:ident) => {
                Value::$variant(<$t>::from_le_bytes(self.array(what)?))
            };
        }
        Ok(match ty {
            0 => le!(u8, U8),
            1 => le!(i8, I8),
            2 => le!(u16, U16),
            3 => le!(i16, I16),
            4 => le!(u32, U32),
            5 => le!(i32, I32),
            6 => le!(f32, F32),
            7 => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(self.corrupt(
                            what(),
                            at,
                            format!("BOOL byte {b} (0 or 1 expected)"),
                        ))
                    }
                }
            }
            8 => Value::String(self.string(what)?),
            9 => {
                let at = self.pos;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt(
                        what(),
                        at,
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let elem = self.u32(|| format!("the element type of {}", what()))?;
                let count = self.u64(|| format!("the length of {}", what()))?;
                let min_size = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => {
                        return Err(self.corrupt(
                            what(),
                            at,
                            format!("array element type {t} ({})", type_name(t)),
                        ))
                    }
                };
                let mut items = Vec::with_capacity(self.fits(count, min_size));
                for i in 0..count {
                    let item = || format!("element {i} of {}", what());
                    items.push(self.value(elem, depth + 1, &item)?);
                }
                Value::Array(items)
            }
            10 => le!(u64, U64),
            11 => le!(i64, I64),
            12 => le!(f64, F64),
            t => {
                let at = self.pos - 4;
                return Err(self.corrupt(what(), at, format!("value type {t} (0 to 12 expected)")));
            }
        })
    }
}
