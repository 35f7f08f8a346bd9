//! Every collective of a [`Communicator`] against values computed on the host: what `cohort
//! gpu nccl` prints (one rank per process, any number of ranks, one GPU or several) and the
//! GPU tests run. Rank r's input holds small multiples of 1/4 scaled by r + 1, exact in bf16,
//! so sums and means over a few ranks are exact in both types and any difference is a fault.
//!
//! This module only reads back what it wrote and compares; it never changes the communicator.

use std::time::Instant;

use cohort_engine::{Backend, Buffer};
use half::bf16;

use crate::{Communicator, NcclError, Reduce};

/// One collective's outcome on this rank.
#[derive(Debug, Clone)]
pub struct Row {
    /// "all_reduce sum".
    pub op: String,
    /// "f32" or "bf16".
    pub dtype: &'static str,
    /// Elements per rank in.
    pub len: usize,
    /// The largest difference from the expected values.
    pub max_err: f64,
    /// Whether it is within the type's tolerance (0 for exact values).
    pub ok: bool,
    /// Wall time of the call (queue and wait), ms.
    pub ms: f64,
}

/// Rank `rank`'s input element `i`.
fn input(rank: usize, i: usize) -> f32 {
    ((i % 13) as f32 - 6.0) * (rank + 1) as f32 / 4.0
}

/// Runs every collective on `comm` with buffers of `backend` (the communicator's GPU), `len`
/// elements per rank; returns one row each. Collective: every rank calls it with the same
/// `len`.
pub fn run(comm: &Communicator, backend: &dyn Backend, len: usize) -> Result<Vec<Row>, NcclError> {
    let (rank, world) = (comm.rank(), comm.world());
    let sum = |i: usize| (0..world).map(|r| input(r, i) as f64).sum::<f64>();
    // This rank's first `n` inputs.
    let mine = |n: usize| (0..n).map(|i| input(rank, i)).collect::<Vec<_>>();
    let mut rows = Vec::new();
    for dtype in ["f32", "bf16"] {
        for (op, name) in [
            (Reduce::Sum, "all_reduce sum"),
            (Reduce::Avg, "all_reduce avg"),
        ] {
            let mut buf = Staged::upload(backend, dtype, &mine(len), rank)?;
            let t = Instant::now();
            buf.all_reduce(comm, op)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let got = buf.download(backend, rank)?;
            let want: Vec<f64> = (0..len)
                .map(|i| match op {
                    Reduce::Sum => sum(i),
                    Reduce::Avg => sum(i) / world as f64,
                })
                .collect();
            rows.push(row(name, dtype, len, &got, &want, ms));
        }
        // reduce_scatter: rank r's `len` = the sum of block r of every rank's world × len.
        let send = Staged::upload(backend, dtype, &mine(len * world), rank)?;
        let mut recv = Staged::upload(backend, dtype, &vec![f32::NAN; len], rank)?;
        let t = Instant::now();
        recv.reduce_scatter(comm, &send)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let got = recv.download(backend, rank)?;
        let want: Vec<f64> = (0..len).map(|i| sum(rank * len + i)).collect();
        rows.push(row("reduce_scatter sum", dtype, len, &got, &want, ms));
        // all_gather: block r of every rank's result = rank r's input.
        let send = Staged::upload(backend, dtype, &mine(len), rank)?;
        let mut recv = Staged::upload(backend, dtype, &vec![f32::NAN; len * world], rank)?;
        let t = Instant::now();
        recv.all_gather(comm, &send)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let got = recv.download(backend, rank)?;
        let want: Vec<f64> = (0..len * world)
            .map(|j| input(j / len, j % len) as f64)
            .collect();
        rows.push(row("all_gather", dtype, len, &got, &want, ms));
        // broadcast from the last rank: every rank ends with its input.
        let root = world - 1;
        let mut buf = Staged::upload(backend, dtype, &mine(len), rank)?;
        let t = Instant::now();
        buf.broadcast(comm, root)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let got = buf.download(backend, rank)?;
        let want: Vec<f64> = (0..len).map(|i| input(root, i) as f64).collect();
        rows.push(row(
            &format!("broadcast from {root}"),
            dtype,
            len,
            &got,
            &want,
            ms,
        ));
    }
    Ok(rows)
}

fn row(op: &str, dtype: &'static str, len: usize, got: &[f32], want: &[f64], ms: f64) -> Row {
    let max_err = if got.len() != want.len() {
        f64::INFINITY
    } else {
        got.iter()
            .zip(want)
            .map(|(&g, &w)| {
                if g.is_nan() {
                    f64::INFINITY
                } else {
                    (g as f64 - w).abs()
                }
            })
            .fold(0.0, f64::max)
    };
    Row {
        op: op.to_string(),
        dtype,
        len,
        max_err,
        ok: max_err == 0.0,
        ms,
    }
}

/// The rows as a table, one line each, with a header.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<22} {:<5} {:>10} {:>10} {:>9}  ok\n",
        "collective", "type", "elements", "max err", "ms"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<22} {:<5} {:>10} {:>10.3e} {:>9.3}  {}\n",
            r.op,
            r.dtype,
            r.len,
            r.max_err,
            r.ms,
            if r.ok { "yes" } else { "NO" }
        ));
    }
    s
}

/// A device buffer holding `len` f32s or bf16s.
struct Staged {
    buf: Buffer,
    dtype: &'static str,
    len: usize,
}

fn engine(rank: usize, op: &'static str) -> impl Fn(cohort_engine::EngineError) -> NcclError {
    move |e| NcclError::Argument {
        op,
        rank,
        what: e.to_string(),
    }
}

impl Staged {
    fn upload(
        backend: &dyn Backend,
        dtype: &'static str,
        host: &[f32],
        rank: usize,
    ) -> Result<Staged, NcclError> {
        let len = host.len();
        let bytes: Vec<u8> = match dtype {
            "f32" => host.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => host
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
        };
        // f32 slots enough for the bytes (bf16: two per slot, rounded up).
        let mut buf = backend
            .alloc(bytes.len().div_ceil(4))
            .map_err(engine(rank, "check: allocate"))?;
        let dst = buf.view_mut().cast::<u8>();
        let n = bytes.len();
        backend
            .copy_from_host(dst.into_slice(..n), &bytes)
            .map_err(engine(rank, "check: upload"))?;
        Ok(Staged { buf, dtype, len })
    }

    fn download(&self, backend: &dyn Backend, rank: usize) -> Result<Vec<f32>, NcclError> {
        let width = if self.dtype == "f32" { 4 } else { 2 };
        let mut bytes = vec![0u8; self.len * width];
        let n = bytes.len();
        backend
            .copy_to_host(&mut bytes, self.buf.view().cast::<u8>().slice(..n))
            .map_err(engine(rank, "check: download"))?;
        Ok(match width {
            4 => bytes
                .chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            _ => bytes
                .chunks(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        })
    }

    fn all_reduce(&mut self, comm: &Communicator, op: Reduce) -> Result<(), NcclError> {
        let len = self.len;
        match self.dtype {
            "f32" => comm.all_reduce(self.buf.view_mut().into_slice(..len), op),
            _ => comm.all_reduce(self.buf.view_mut().cast::<u16>().into_slice(..len), op),
        }
    }

    fn reduce_scatter(&mut self, comm: &Communicator, send: &Staged) -> Result<(), NcclError> {
        let (len, slen) = (self.len, send.len);
        match self.dtype {
            "f32" => comm.reduce_scatter(
                send.buf.view().slice(..slen),
                self.buf.view_mut().into_slice(..len),
                Reduce::Sum,
            ),
            _ => comm.reduce_scatter(
                send.buf.view().cast::<u16>().slice(..slen),
                self.buf.view_mut().cast::<u16>().into_slice(..len),
                Reduce::Sum,
            ),
        }
    }

    fn all_gather(&mut self, comm: &Communicator, send: &Staged) -> Result<(), NcclError> {
        let (len, slen) = (self.len, send.len);
        match self.dtype {
            "f32" => comm.all_gather(
                send.buf.view().slice(..slen),
                self.buf.view_mut().into_slice(..len),
            ),
            _ => comm.all_gather(
                send.buf.view().cast::<u16>().slice(..slen),
                self.buf.view_mut().cast::<u16>().into_slice(..len),
            ),
        }
    }

    fn broadcast(&mut self, comm: &Communicator, root: usize) -> Result<(), NcclError> {
        let len = self.len;
        match self.dtype {
            "f32" => comm.broadcast(self.buf.view_mut().into_slice(..len), root),
            _ => comm.broadcast(self.buf.view_mut().cast::<u16>().into_slice(..len), root),
        }
    }
}
