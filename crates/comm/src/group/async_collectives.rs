//! The `*_async` collectives of [`ProcessGroup`]: each checks its
//! arguments like its blocking twin, then queues the call on the group's
//! worker and returns a [`Work`] that hands the buffers back.
//!
//! Ordering, sequence numbers and aborts stay in the group; this module
//! must never run a collective itself.

use crate::element::{as_bytes, as_bytes_mut, Element};
use crate::kinds::OpKind;
use crate::reduce_op::ReduceOp;
use crate::work::Work;

use super::{Issue, ProcessGroup};

impl ProcessGroup {
    /// Async [`broadcast`](Self::broadcast); the work gives `buf` back.
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_rank(OpKind::Broadcast, "root", root) {
            return Work::failed(OpKind::Broadcast, e);
        }
        self.submit(
            Issue::of(OpKind::Broadcast, &buf),
            Box::new(move |b, ctx| {
                b.broadcast(ctx, as_bytes_mut(&mut buf), T::DTYPE, root)
                    .map(|()| buf)
            }),
        )
    }

    /// Async [`reduce`](Self::reduce); the work gives `buf` back.
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Work<Vec<T>> {
        let checked = self
            .check_rank(OpKind::Reduce, "root", root)
            .and_then(|()| self.check_reduce(OpKind::Reduce, T::DTYPE, op));
        if let Err(e) = checked {
            return Work::failed(OpKind::Reduce, e);
        }
        self.submit(
            Issue::of(OpKind::Reduce, &buf),
            Box::new(move |b, ctx| {
                b.reduce(ctx, as_bytes_mut(&mut buf), T::DTYPE, op, root)
                    .map(|()| buf)
            }),
        )
    }

    /// Async [`all_reduce`](Self::all_reduce); the work gives `buf` back.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        if let Err(e) = self.check_reduce(OpKind::AllReduce, T::DTYPE, op) {
            return Work::failed(OpKind::AllReduce, e);
        }
        self.submit(
            Issue::of(OpKind::AllReduce, &buf),
            Box::new(move |b, ctx| {
                b.all_reduce(ctx, as_bytes_mut(&mut buf), T::DTYPE, op)
                    .map(|()| buf)
            }),
        )
    }

    /// Async [`reduce_scatter`](Self::reduce_scatter); the work gives
    /// `(input, output)` back.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        let checked = self
            .check_len(
                OpKind::ReduceScatter,
                "input",
                input.len(),
                output.len() * self.size(),
            )
            .and_then(|()| self.check_reduce(OpKind::ReduceScatter, T::DTYPE, op));
        if let Err(e) = checked {
            return Work::failed(OpKind::ReduceScatter, e);
        }
        self.submit(
            OpKind::ReduceScatter,
            Box::new(move |b, ctx| {
                b.reduce_scatter(
                    ctx,
                    as_bytes(&input),
                    as_bytes_mut(&mut output),
                    T::DTYPE,
                    op,
                )
                .map(|()| (input, output))
            }),
        )
    }

    /// Async [`all_gather`](Self::all_gather); the work gives `(input, output)` back.
    pub fn all_gather_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        if let Err(e) = self.check_len(
            OpKind::AllGather,
            "output",
            output.len(),
            input.len() * self.size(),
        ) {
            return Work::failed(OpKind::AllGather, e);
        }
        self.submit(
            OpKind::AllGather,
            Box::new(move |b, ctx| {
                b.all_gather(ctx, as_bytes(&input), as_bytes_mut(&mut output), T::DTYPE)
                    .map(|()| (input, output))
            }),
        )
    }

    /// Async [`gather`](Self::gather); the work gives `(input, output)` back.
    pub fn gather_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Option<Vec<T>>,
        root: usize,
    ) -> Work<(Vec<T>, Option<Vec<T>>)> {
        if let Err(e) = self.check_gather(root, input.len(), output.as_ref().map(Vec::len)) {
            return Work::failed(OpKind::Gather, e);
        }
        self.submit(
            OpKind::Gather,
            Box::new(move |b, ctx| {
                b.gather(
                    ctx,
                    as_bytes(&input),
                    output.as_deref_mut().map(as_bytes_mut),
                    T::DTYPE,
                    root,
                )
                .map(|()| (input, output))
            }),
        )
    }

    /// Async [`scatter`](Self::scatter); the work gives `(input, output)` back.
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        mut output: Vec<T>,
        root: usize,
    ) -> Work<(Option<Vec<T>>, Vec<T>)> {
        if let Err(e) = self.check_scatter(root, input.as_ref().map(Vec::len), output.len()) {
            return Work::failed(OpKind::Scatter, e);
        }
        self.submit(
            OpKind::Scatter,
            Box::new(move |b, ctx| {
                b.scatter(
                    ctx,
                    input.as_deref().map(as_bytes),
                    as_bytes_mut(&mut output),
                    T::DTYPE,
                    root,
                )
                .map(|()| (input, output))
            }),
        )
    }

    /// Async [`all_to_all`](Self::all_to_all); the work gives `(input, output)` back.
    pub fn all_to_all_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        if let Err(e) = self.check_all_to_all(input.len(), output.len()) {
            return Work::failed(OpKind::AllToAll, e);
        }
        self.submit(
            OpKind::AllToAll,
            Box::new(move |b, ctx| {
                b.all_to_all(ctx, as_bytes(&input), as_bytes_mut(&mut output), T::DTYPE)
                    .map(|()| (input, output))
            }),
        )
    }

    /// Async [`barrier`](Self::barrier).
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(OpKind::Barrier, Box::new(|b, ctx| b.barrier(ctx)))
    }
}
