//! [`join`]: NCCL for a process group, or the agreed reason not to use it. Every rank says
//! whether it can run NCCL and which GPU it is on (its host and the GPU's PCI address); the
//! ranks all-gather that over the group, so that they all take the same way:
//!
//! - NCCL missing on some rank: [`Policy::Required`] fails on every rank naming those ranks;
//!   [`Policy::Preferred`] stages through the host.
//! - Several ranks on one GPU: NCCL 2.30 and later runs them when `NCCL_MULTI_RANK_GPU_ENABLE=1`
//!   is set on every rank, and only when NCCL is required; otherwise required is refused with
//!   the fix named, and preferred stages through the host (the default keeps NCCL for one
//!   rank per GPU, PyTorch's advice).
//! - Otherwise rank 0's unique id goes round through the group's store and the communicator
//!   is made on every rank.
//!
//! This module never makes a communicator some rank would not make too.

use cohort_comm::ProcessGroup;
use cohort_cuda::libraries::Search;
use cudarc::driver::{result, sys};

use crate::comm::{Binding, Communicator};
use crate::{exchange_id, load, Nccl, NcclError, Version};

/// How much the caller wants NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Asked for by name (`--backend nccl`): NCCL or an error.
    Required,
    /// The default: NCCL where every rank has a GPU of its own and NCCL loads everywhere,
    /// else staging through the host, with the reason.
    Preferred,
}

/// What [`join`] settled on.
#[derive(Debug)]
pub enum Joined {
    /// NCCL, this rank's communicator.
    Nccl(Communicator),
    /// Staging through the host, for the reason given (the same on every rank, one line).
    Staged(String),
}

/// The environment variable with which NCCL 2.30+ runs several ranks on one GPU.
pub const MULTI_RANK_GPU_ENV: &str = "NCCL_MULTI_RANK_GPU_ENABLE";

/// NCCL over `pg` on `binding`'s GPU and stream, or host staging, as `policy` allows (see the
/// module doc); `key` scopes the store key of the unique id (unique per communicator and
/// restart). Collective over `pg`; waits at most the group's timeout for the others.
pub fn join(
    pg: &ProcessGroup,
    search: &Search,
    binding: Binding,
    key: &str,
    policy: Policy,
) -> Result<Joined, NcclError> {
    const OP: &str = "set-up";
    let (rank, world) = (pg.rank(), pg.size());
    let local =
        load(search).and_then(|nccl| Ok((nccl, gpu_identity(search, binding.ordinal, rank)?)));
    let allows_shared = |nccl: &Nccl| {
        nccl.version().at_least(2, 30)
            && std::env::var(MULTI_RANK_GPU_ENV).is_ok_and(|v| v.trim() == "1")
    };
    let mine: [i64; 2] = match &local {
        Ok((nccl, (_, hash))) => [*hash, allows_shared(nccl) as i64],
        Err(_) => [0, 0],
    };
    let mut all = vec![0i64; 2 * world];
    pg.all_gather(&mine, &mut all)
        .map_err(|e| NcclError::Group {
            op: OP,
            rank,
            reason: e.to_string(),
        })?;
    match decide(&all, policy) {
        Decision::Go => {}
        Decision::Stage(why) => return Ok(Joined::Staged(why)),
        Decision::Missing(ranks) => {
            return Err(NcclError::Unavailable {
                rank,
                ranks,
                local: local.as_ref().err().map(|e| e.to_string()),
            })
        }
        Decision::Shared(a, b) => {
            let (nccl, (gpu, _)) = local.expect("every rank has NCCL: decided so");
            return Err(shared_gpu(rank, (a, b), gpu, nccl.version()));
        }
    }
    let (nccl, _) = local.expect("every rank has NCCL: decided so");
    let timeout = pg.timeout();
    let id = exchange_id(
        nccl,
        &*pg.store(),
        &format!("{key}/unique-id"),
        rank,
        timeout,
    )?;
    Communicator::new(nccl, search, &id, (rank, world), binding, timeout).map(Joined::Nccl)
}

/// What the ranks' (GPU key, allows several ranks per GPU) pairs decide.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Make the communicator.
    Go,
    /// Stage through the host, for this reason.
    Stage(String),
    /// Required, but NCCL is missing on these ranks ("1, 3").
    Missing(String),
    /// Required, but these ranks share a GPU and some rank's NCCL refuses that.
    Shared(usize, usize),
}

/// The same decision on every rank, from every rank's pair (`all`, rank after rank): a GPU
/// key (0: no NCCL there) and whether its NCCL runs several ranks on one GPU.
fn decide(all: &[i64], policy: Policy) -> Decision {
    let keys: Vec<i64> = all.chunks(2).map(|c| c[0]).collect();
    let missing: Vec<String> = (0..keys.len())
        .filter(|&r| keys[r] == 0)
        .map(|r| r.to_string())
        .collect();
    if !missing.is_empty() {
        return match policy {
            Policy::Required => Decision::Missing(missing.join(", ")),
            Policy::Preferred => Decision::Stage(format!(
                "NCCL is not available on rank(s) {}",
                missing.join(", ")
            )),
        };
    }
    let Some((a, b)) = shared_pair(&keys) else {
        return Decision::Go;
    };
    match policy {
        Policy::Preferred => Decision::Stage(format!(
            "ranks {a} and {b} share a GPU (NCCL is the default for one rank per GPU)"
        )),
        Policy::Required if all.chunks(2).all(|c| c[1] == 1) => Decision::Go,
        Policy::Required => Decision::Shared(a, b),
    }
}

/// The refusal of ranks `a` and `b` on one GPU, naming the fix for this NCCL `version`.
fn shared_gpu(rank: usize, (a, b): (usize, usize), gpu: String, version: Version) -> NcclError {
    let fix = if version.at_least(2, 30) {
        format!(
            "runs that only with {MULTI_RANK_GPU_ENV}=1 on every rank: set it, or stage \
             through the host (--backend cohort)"
        )
    } else {
        format!(
            "refuses that (NCCL 2.30 or later runs it with {MULTI_RANK_GPU_ENV}=1): stage \
             through the host (--backend cohort)"
        )
    };
    NcclError::SharedGpu {
        rank,
        ranks: format!("{a} and {b}"),
        gpu,
        version: version.to_string(),
        fix,
    }
}

/// The first two ranks with one GPU key, if any.
fn shared_pair(keys: &[i64]) -> Option<(usize, usize)> {
    (0..keys.len()).find_map(|b| (0..b).find(|&a| keys[a] == keys[b]).map(|a| (a, b)))
}

/// This rank's GPU as text ("host:0000:17:00.0") and as a key that two ranks share exactly
/// when they share the GPU (never 0, which means "no NCCL here").
fn gpu_identity(search: &Search, ordinal: usize, rank: usize) -> Result<(String, i64), NcclError> {
    let driver = |e: cudarc::driver::DriverError| NcclError::Driver {
        op: "set-up",
        rank,
        reason: format!("{:?}", e.0),
    };
    let count = cohort_cuda::device_count(search)?;
    if ordinal >= count {
        return Err(NcclError::Driver {
            op: "set-up",
            rank,
            reason: format!("no GPU {ordinal}: the driver sees {count}"),
        });
    }
    let dev = result::device::get(ordinal as i32).map_err(driver)?;
    let attr = |a| {
        // SAFETY: the driver is initialised (device_count) and `dev` is a valid device.
        unsafe { result::device::get_attribute(dev, a) }.map_err(driver)
    };
    use sys::CUdevice_attribute as A;
    let (domain, bus, device) = (
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
    );
    let text = format!("{}:{domain:04x}:{bus:02x}:{device:02x}.0", host_name());
    Ok((text.clone(), fnv1a(text.as_bytes())))
}

/// This host's name (empty when it has none).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates within it
    // when the name fits (the last byte is kept 0 for when it does not).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// FNV-1a, never 0: the same on every rank (all run one binary or not, it is fixed).
fn fnv1a(bytes: &[u8]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h as i64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_shared_pair_is_found() {
        assert_eq!(shared_pair(&[5, 6, 7]), None);
        assert_eq!(shared_pair(&[5, 6, 5, 6]), Some((0, 2)));
        assert_eq!(shared_pair(&[5, 6, 6]), Some((1, 2)));
    }

    #[test]
    fn every_rank_decides_the_same_from_the_gathered_pairs() {
        use Policy::{Preferred, Required};
        // Two GPUs, NCCL everywhere: NCCL either way.
        assert_eq!(decide(&[5, 0, 6, 0], Preferred), Decision::Go);
        assert_eq!(decide(&[5, 0, 6, 0], Required), Decision::Go);
        // NCCL missing on rank 1.
        assert_eq!(
            decide(&[5, 1, 0, 0], Required),
            Decision::Missing("1".into())
        );
        assert_eq!(
            decide(&[5, 1, 0, 0], Preferred),
            Decision::Stage("NCCL is not available on rank(s) 1".into())
        );
        // One GPU: the default stages; required runs only where every rank allows it.
        assert!(
            matches!(decide(&[5, 1, 5, 1], Preferred), Decision::Stage(w) if w.contains("ranks 0 and 1 share a GPU"))
        );
        assert_eq!(decide(&[5, 1, 5, 1], Required), Decision::Go);
        assert_eq!(decide(&[5, 1, 5, 0], Required), Decision::Shared(0, 1));
        assert_eq!(
            decide(&[7, 0, 5, 0, 5, 0], Required),
            Decision::Shared(1, 2)
        );
    }

    #[test]
    fn the_shared_gpu_refusal_names_the_fix_for_each_release() {
        let old = shared_gpu(1, (0, 1), "h:0000:17:00.0".into(), Version(22803)).to_string();
        assert_eq!(
            old,
            "NCCL on rank 1: ranks 0 and 1 share one GPU (h:0000:17:00.0); NCCL 2.28.3 refuses \
             that (NCCL 2.30 or later runs it with NCCL_MULTI_RANK_GPU_ENABLE=1): stage through \
             the host (--backend cohort)"
        );
        let new = shared_gpu(0, (0, 1), "h:0000:17:00.0".into(), Version(23007)).to_string();
        assert!(
            new.contains(
                "NCCL 2.30.7 runs that only with NCCL_MULTI_RANK_GPU_ENABLE=1 on every rank"
            ),
            "{new}"
        );
        assert!(
            new.contains("--backend cohort") && !new.contains('\n'),
            "{new}"
        );
    }

    #[test]
    fn gpu_keys_are_never_zero_and_differ_by_bus() {
        assert_ne!(fnv1a(b"h:0000:17:00.0"), fnv1a(b"h:0000:18:00.0"));
        assert!(fnv1a(b"") != 0);
    }
}
