//! The binary header of a GGUF file: magic, version, metadata key/values, tensor infos, and where
//! tensor data starts. Read here rather than by a general tensor library because a model file
//! may use any type the kernels run (`WeightType`), and a crafted file must be refused with a
//! clear message, never a panic, an overflow or an allocation the file does not back.
//!
//! Layout (GGUF v2/v3; v1 writes lengths and dimensions as u32): magic `GGUF`, version u32,
//! tensor count, metadata count, metadata (key string, value type u32, value), tensor infos
//! (name string, dimension count u32, dimensions fastest first, ggml type u32, offset u64),
//! padding to `general.alignment` (32 when absent), tensor data.

use std::collections::HashMap;

use cachet_kernels::WeightType;

/// One metadata value, as GGUF types it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

/// Where one tensor lies and what it holds.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Row-major dimensions (`[rows, cols]` for a matrix): GGUF's order reversed.
    pub dims: Vec<usize>,
    pub weight_type: WeightType,
    /// Offset of its bytes from the start of the tensor data.
    pub offset: u64,
}

/// A parsed header.
#[derive(Debug)]
pub struct Header {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Offset of the tensor data in the file.
    pub data_offset: u64,
}

/// Why a header was refused.
#[derive(Debug, PartialEq)]
pub enum HeaderError {
    /// Not a well-formed GGUF header.
    Format(String),
    /// A tensor of a type the kernels do not run (`ggml_name` is ggml's name for it).
    UnsupportedType { tensor: String, ggml_name: String },
}

impl From<String> for HeaderError {
    fn from(s: String) -> Self {
        HeaderError::Format(s)
    }
}

/// Deepest nesting of arrays accepted.
const MAX_VALUE_DEPTH: usize = 64;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Alignment of the tensor data when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Longest tensor name quoted in an error.
const QUOTED_NAME_CHARS: usize = 80;

/// Parses the header at the start of `b` (the whole file).
pub fn parse(b: &[u8]) -> Result<Header, HeaderError> {
    let mut r = Reader {
        b,
        pos: 0,
        wide: true,
    };
    let magic = r.u32()?;
    if magic != 0x4655_4747 {
        return Err(format!("not a GGUF file (magic 0x{magic:08x})").into());
    }
    r.wide = match r.u32()? {
        1 => false,
        2 | 3 => true,
        v => return Err(format!("unsupported GGUF version {v}").into()),
    };
    let n_tensors = r.len()?;
    let n_entries = r.len()?;
    let mut metadata = HashMap::new();
    for _ in 0..n_entries {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty, 0)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match integer(v) {
            Some(a) if a.is_power_of_two() => a,
            Some(a) => return Err(format!("general.alignment {a} is not a power of two").into()),
            None => return Err(format!("general.alignment {v:?} is not a power of two").into()),
        },
    };
    let mut tensors = HashMap::new();
    for _ in 0..n_tensors {
        let (name, info) = r.tensor_info()?;
        tensors.insert(name, info);
    }
    let data_offset = (r.pos as u64).next_multiple_of(alignment);
    Ok(Header {
        metadata,
        tensors,
        data_offset,
    })
}

/// A non-negative integer value.
pub fn integer(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(u64::from(x)),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::U16(x) => Some(u64::from(x)),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::U32(x) => Some(u64::from(x)),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::U64(x) => Some(x),
        Value::I64(x) => u64::try_from(x).ok(),
        Value::Bool(b) => Some(u64::from(b)),
        _ => None,
    }
}

/// Reads the little-endian scalars, strings and arrays of a GGUF header.
struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
    /// v2 and v3 write lengths as u64, v1 as u32.
    wide: bool,
}

impl Reader<'_> {
    fn take(&mut self, n: u64) -> Result<&[u8], String> {
        let left = self.b.len() - self.pos;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| format!("needs {n} bytes at offset {}, {left} left", self.pos))?;
        let out = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn len(&mut self) -> Result<u64, String> {
        if self.wide {
            self.u64()
        } else {
            self.u32().map(u64::from)
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array()?)),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(u32::from_le_bytes(self.array()?)),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_VALUE_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_VALUE_DEPTH}"));
                }
                let elem = self.u32()?;
                let n = self.len()?;
                // Every element takes at least one byte: a count the file cannot hold fails
                // before anything is allocated for it.
                let left = (self.b.len() - self.pos) as u64;
                if n > left {
                    return Err(format!("array of {n} values with {left} bytes left"));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array()?)),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown value type {other}")),
        })
    }

    fn tensor_info(&mut self) -> Result<(String, TensorInfo), HeaderError> {
        let name = self.string()?;
        let quoted = || name.chars().take(QUOTED_NAME_CHARS).collect::<String>();
        let n_dims = self.u32()?;
        if n_dims > MAX_DIMS {
            return Err(format!("tensor '{}' has {n_dims} dimensions", quoted()).into());
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = self.len()?;
            dims.push(usize::try_from(d).map_err(|_| {
                HeaderError::Format(format!("tensor '{}' dimension {d} overflows", quoted()))
            })?);
        }
        dims.reverse();
        let id = self.u32()?;
        let offset = self.u64()?;
        let weight_type =
            WeightType::from_ggml_type_id(id).map_err(|_| HeaderError::UnsupportedType {
                tensor: quoted(),
                ggml_name: ggml_type_name(id),
            })?;
        Ok((
            name,
            TensorInfo {
                dims,
                weight_type,
                offset,
            },
        ))
    }
}

/// ggml's name of type id `id` (`ggml_type_name`), for types the kernels do not run too.
fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
        "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
        "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    match id {
        34 => "TQ1_0".to_string(),
        35 => "TQ2_0".to_string(),
        39 => "MXFP4".to_string(),
        _ => NAMES
            .get(id as usize)
            .map_or_else(|| format!("with ggml id {id}"), |n| n.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v3 header: `meta` as (key, type, value bytes), then `tensors` as (name, dims fastest
    /// first, type id, offset).
    fn header(meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        for (k, ty, v) in meta {
            s(&mut b, k);
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(v);
        }
        for (name, dims, ty, off) in tensors {
            s(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        b
    }

    #[test]
    fn reads_values_tensors_and_the_aligned_data_offset() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&2u64.to_le_bytes());
        for w in ["a", "bc"] {
            arr.extend_from_slice(&(w.len() as u64).to_le_bytes());
            arr.extend_from_slice(w.as_bytes());
        }
        let b = header(
            &[
                ("x.u32", 4, 7u32.to_le_bytes().to_vec()),
                ("x.f32", 6, 0.5f32.to_le_bytes().to_vec()),
                ("x.words", 9, arr),
                ("general.alignment", 4, 64u32.to_le_bytes().to_vec()),
            ],
            // IQ4_XS (23): a type candle's reader refused.
            &[("w", &[256, 3], 23, 0)],
        );
        let h = parse(&b).expect("header");
        assert_eq!(h.metadata["x.u32"], Value::U32(7));
        assert_eq!(h.metadata["x.f32"], Value::F32(0.5));
        assert_eq!(
            h.metadata["x.words"],
            Value::Array(vec![Value::String("a".into()), Value::String("bc".into())])
        );
        let w = &h.tensors["w"];
        assert_eq!(w.dims, vec![3, 256]);
        assert_eq!(w.weight_type, WeightType::IQ4XS);
        assert_eq!(h.data_offset, (b.len() as u64).next_multiple_of(64));
    }

    #[test]
    fn refuses_an_unsupported_type_by_name() {
        let b = header(&[], &[("blk.0.ffn_up.weight", &[32, 2], 16, 0)]);
        assert_eq!(
            parse(&b).unwrap_err(),
            HeaderError::UnsupportedType {
                tensor: "blk.0.ffn_up.weight".into(),
                ggml_name: "IQ2_XXS".into()
            }
        );
    }

    #[test]
    fn refuses_counts_the_file_cannot_hold() {
        // An array claiming 2^40 u8 values in a few bytes: refused before allocating.
        let mut arr = 0u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let b = header(&[("x", 9, arr)], &[]);
        assert!(matches!(parse(&b), Err(HeaderError::Format(m)) if m.contains("array of")));
        // A zero alignment.
        let b = header(
            &[("general.alignment", 4, 0u32.to_le_bytes().to_vec())],
            &[],
        );
        assert!(matches!(parse(&b), Err(HeaderError::Format(m)) if m.contains("power of two")));
        // Five dimensions.
        let b = header(&[], &[("t", &[1, 1, 1, 1, 1], 0, 0)]);
        assert!(matches!(parse(&b), Err(HeaderError::Format(m)) if m.contains("5 dimensions")));
    }
}
