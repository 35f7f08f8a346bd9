//! The functions a worker serves: typed handlers registered by name.
//!
//! Rust has no pickling, so a call names a function that the callee
//! registered before joining, and the arguments and result cross the wire
//! as postcard-encoded serde values. A [`Registry`] erases each handler's
//! types behind a function on bytes and remembers a fingerprint of them, so
//! that a caller who asks for the wrong types gets [`RpcError::TypeMismatch`]
//! instead of a value decoded from the wrong bytes. This module runs
//! handlers but never touches a socket.

use std::any::Any;
use std::collections::HashMap;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::agent::Rpc;

/// Who is being served: the caller, and this worker's agent (to call others
/// from inside a handler).
pub struct CallContext {
    pub(crate) caller: WorkerInfo,
    pub(crate) rpc: Rpc,
}

impl CallContext {
    /// The worker that made the call.
    pub fn caller(&self) -> &WorkerInfo {
        &self.caller
    }

    /// This worker's agent.
    pub fn rpc(&self) -> &Rpc {
        &self.rpc
    }
}

/// A worker of the group: its name and rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerInfo {
    /// The name it joined with (`init_rpc(name, ..)`).
    pub name: String,
    /// Its rank.
    pub rank: usize,
}

/// A handler's result, kept typed: encoded at once for a call, or held as a
/// remote reference's value on its owner.
pub(crate) struct Value {
    pub(crate) value: Arc<dyn Any + Send + Sync>,
    encode: fn(&(dyn Any + Send + Sync)) -> Result<Vec<u8>, String>,
    /// Fingerprint of the value's type.
    pub(crate) ty: u64,
}

impl Value {
    pub(crate) fn new<R: Serialize + Send + Sync + 'static>(r: R) -> Value {
        Value {
            value: Arc::new(r),
            encode: encode_as::<R>,
            ty: type_id::<R>(),
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, String> {
        (self.encode)(&*self.value)
    }
}

fn encode_as<R: Serialize + 'static>(v: &(dyn Any + Send + Sync)) -> Result<Vec<u8>, String> {
    let r = v
        .downcast_ref::<R>()
        .expect("a Value's encoder is made for its own type");
    postcard::to_allocvec(r).map_err(|e| e.to_string())
}

/// Why a handler produced no value.
pub(crate) enum Failure {
    /// The arguments did not decode.
    Decode(String),
    /// The handler returned an error or panicked.
    Handler(String),
}

type Erased = dyn Fn(&CallContext, &[u8]) -> Result<Value, Failure> + Send + Sync;

pub(crate) struct Handler {
    run: Box<Erased>,
    /// Fingerprint of (argument type, result type).
    pub(crate) types: u64,
    /// `Args -> Result`, for error messages.
    pub(crate) signature: String,
}

impl Handler {
    /// Runs the handler; a panic is caught and reported as its failure.
    pub(crate) fn call(&self, ctx: &CallContext, args: &[u8]) -> Result<Value, Failure> {
        match catch_unwind(AssertUnwindSafe(|| (self.run)(ctx, args))) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string panic".to_string());
                Err(Failure::Handler(format!("panicked: {msg}")))
            }
        }
    }
}

/// The functions a worker serves, by name; handed to
/// [`init_rpc`](crate::init_rpc) so that they exist before any peer can call.
#[derive(Default)]
pub struct Registry {
    pub(crate) handlers: HashMap<String, Handler>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Registers `f` as `name`, replacing any earlier handler of that name.
    /// `f` runs on the agent's handler threads, so it may block and may call
    /// other workers through [`CallContext::rpc`]; an `Err` or a panic comes
    /// back to the caller as [`RpcError::Handler`](crate::RpcError::Handler)
    /// with its message and this worker's name.
    pub fn register<A, R, E, F>(&mut self, name: &str, f: F) -> &mut Registry
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        E: Display,
        F: Fn(&CallContext, A) -> Result<R, E> + Send + Sync + 'static,
    {
        let run = move |ctx: &CallContext, bytes: &[u8]| -> Result<Value, Failure> {
            let args: A =
                postcard::from_bytes(bytes).map_err(|e| Failure::Decode(e.to_string()))?;
            match f(ctx, args) {
                Ok(r) => Ok(Value::new(r)),
                Err(e) => Err(Failure::Handler(e.to_string())),
            }
        };
        self.handlers.insert(
            name.to_string(),
            Handler {
                run: Box::new(run),
                types: call_types::<A, R>(),
                signature: signature::<A, R>(),
            },
        );
        self
    }

    /// The registered names, sorted and comma-separated (for errors).
    pub(crate) fn names(&self) -> String {
        let mut v: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        v.sort_unstable();
        v.join(", ")
    }
}

/// `A -> R` as a human reads it.
pub(crate) fn signature<A: ?Sized, R: ?Sized>() -> String {
    format!(
        "{} -> {}",
        std::any::type_name::<A>(),
        std::any::type_name::<R>()
    )
}

/// Fingerprint of a type: FNV-1a of its name. Stable for one build of the
/// program (what every worker of a job runs); a job that mixes builds with
/// different type names gets a clear mismatch, never a wrong decode.
pub(crate) fn type_id<T: ?Sized>() -> u64 {
    fnv(std::any::type_name::<T>().as_bytes(), 0xcbf2_9ce4_8422_2325)
}

pub(crate) fn call_types<A: ?Sized, R: ?Sized>() -> u64 {
    fnv(
        std::any::type_name::<R>().as_bytes(),
        type_id::<A>() ^ 0x5bd1_e995,
    )
}

fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_tell_types_apart() {
        assert_ne!(type_id::<u32>(), type_id::<i32>());
        assert_ne!(call_types::<u32, i32>(), call_types::<i32, u32>());
        assert_eq!(call_types::<Vec<f32>, ()>(), call_types::<Vec<f32>, ()>());
        assert_eq!(signature::<(i64, i64), i64>(), "(i64, i64) -> i64");
    }
}
