//! HTTP request and answer bodies, for every front end on the HTTP port: a body is read up to
//! a fixed limit (413 past it, after draining a little more so the client sees the answer
//! rather than a reset), inflated when it comes gzip- or deflate-compressed (`Content-Encoding`,
//! the inflated size bounded by the same limit), and an answer is compressed in the coding
//! `Accept-Encoding` prefers. This module never parses what a body says.

use std::io::Read;

use axum::body::Body;
use axum::http::{header, HeaderMap};

use crate::error::ServeError;

/// Past the limit, this much more of a body is still read (and dropped) so that the client,
/// still sending, receives the 413 instead of a reset connection.
const DRAIN_BYTES: u64 = 64 << 20;

/// A compression the protocol's clients use: tritonclient's `request_compression_algorithm`
/// and `response_compression_algorithm` ("gzip", "deflate"; HTTP's deflate is the zlib format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coding {
    Gzip,
    Deflate,
}

impl Coding {
    /// The coding's name in `Content-Encoding` / `Accept-Encoding`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }

    /// `bytes` compressed in this coding (fast level: answers are compressed on the way out).
    pub(crate) fn compress(self, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
        use std::io::Write;
        let level = flate2::Compression::fast();
        match self {
            Coding::Gzip => {
                let mut w = flate2::write::GzEncoder::new(Vec::new(), level);
                w.write_all(bytes).and_then(|()| w.finish())
            }
            Coding::Deflate => {
                let mut w = flate2::write::ZlibEncoder::new(Vec::new(), level);
                w.write_all(bytes).and_then(|()| w.finish())
            }
        }
    }
}

/// The body's `Content-Encoding`: None for identity; an error naming an unsupported one.
fn content_coding(headers: &HeaderMap) -> Result<Option<Coding>, ServeError> {
    let Some(enc) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(None);
    };
    match enc
        .to_str()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
        .as_str()
    {
        "" | "identity" => Ok(None),
        "gzip" | "x-gzip" => Ok(Some(Coding::Gzip)),
        "deflate" => Ok(Some(Coding::Deflate)),
        _ => Err(ServeError::malformed(format!(
            "Content-Encoding {enc:?} is not supported (gzip, deflate or identity)"
        ))),
    }
}

/// Inflates `body`, refusing (413) what inflates past `limit` bytes without inflating more.
fn inflate(body: &[u8], coding: Coding, limit: usize) -> Result<Vec<u8>, ServeError> {
    let reader: Box<dyn Read + '_> = match coding {
        Coding::Gzip => Box::new(flate2::read::MultiGzDecoder::new(body)),
        Coding::Deflate => Box::new(flate2::read::ZlibDecoder::new(body)),
    };
    let mut out = Vec::new();
    reader
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| {
            ServeError::malformed(format!("the {} body does not inflate: {e}", coding.name()))
        })?;
    if out.len() > limit {
        return Err(ServeError::BodyTooLarge { limit });
    }
    Ok(out)
}

/// The body, inflated if it is compressed, refused past `limit` bytes (either way).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, ServeError> {
    let coding = content_coding(headers)?;
    let raw = read_raw_body(headers, body, limit).await?;
    match coding {
        None => Ok(raw),
        Some(c) => Ok(inflate(&raw, c, limit)?.into()),
    }
}

/// Which compression the client accepts for the answer, by `Accept-Encoding` (gzip first).
pub(crate) fn accepted_coding(headers: &HeaderMap) -> Option<Coding> {
    let mut best: Option<Coding> = None;
    for v in headers.get_all(header::ACCEPT_ENCODING) {
        for item in v.to_str().unwrap_or("").split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            // "gzip;q=0" refuses gzip
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    == Some(0.0)
            });
            let c = match name.as_str() {
                "gzip" | "x-gzip" => Coding::Gzip,
                "deflate" => Coding::Deflate,
                _ => continue,
            };
            if !refused && best != Some(Coding::Gzip) {
                best = Some(c);
            }
        }
    }
    best
}

async fn read_raw_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, ServeError> {
    use tokio_stream::StreamExt;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64 + DRAIN_BYTES) {
        return Err(ServeError::BodyTooLarge { limit });
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| n.min(limit as u64) as usize));
    let mut seen = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ServeError::malformed(format!("reading the body: {e}")))?;
        seen += chunk.len() as u64;
        if seen > limit as u64 + DRAIN_BYTES {
            break;
        }
        if seen <= limit as u64 {
            buf.extend_from_slice(&chunk);
        }
    }
    if seen > limit as u64 {
        return Err(ServeError::BodyTooLarge { limit });
    }
    Ok(buf.into())
}
