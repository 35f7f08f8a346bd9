//! [`Floats`]: a `Vec<f32>` that crosses the wire as one block of bytes.
//!
//! serde sees a `Vec<f32>` as a sequence and encodes it element by element;
//! gradients and parameters of millions of floats are better sent as their
//! little-endian bytes, copied in one go. This module only converts.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A vector of `f32` serialized as its little-endian bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Floats(pub Vec<f32>);

impl Serialize for Floats {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if cfg!(target_endian = "little") {
            // safety: f32 has no padding and every bit pattern is a valid
            // u8; the byte view covers exactly the vector's elements.
            let bytes = unsafe {
                std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 4)
            };
            s.serialize_bytes(bytes)
        } else {
            let bytes: Vec<u8> = self.0.iter().flat_map(|x| x.to_le_bytes()).collect();
            s.serialize_bytes(&bytes)
        }
    }
}

impl<'de> Deserialize<'de> for Floats {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Floats;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("f32 values as little-endian bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<Floats, E> {
                if !b.len().is_multiple_of(4) {
                    return Err(E::custom(format!(
                        "{} bytes is not a whole number of f32",
                        b.len()
                    )));
                }
                Ok(Floats(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, b: Vec<u8>) -> Result<Floats, E> {
                self.visit_bytes(&b)
            }
        }
        d.deserialize_bytes(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_bitwise() {
        let v = Floats(vec![1.5, -0.0, f32::NAN, f32::MIN_POSITIVE, 3e38]);
        let bytes = postcard::to_allocvec(&v).unwrap();
        assert_eq!(bytes.len(), 1 + 20, "a length byte, then the raw floats");
        let back: Floats = postcard::from_bytes(&bytes).unwrap();
        let bits = |f: &Floats| f.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&v));
        assert!(postcard::from_bytes::<Floats>(&[3, 1, 2, 3]).is_err());
    }
}
