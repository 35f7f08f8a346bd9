//! Group settings and the environment variables that set them.
//!
//! `COHORT_TIMEOUT` (seconds, or a number with `ms`/`s`/`m`/`h`),
//! `COHORT_ALGO` (`auto`, `ring`, `tree`, `shm`, `hierarchical`),
//! `COHORT_DEBUG` (`off`, `detail`), `COHORT_SOCKET_ADDR` (the IP this rank
//! listens on) and `COHORT_TRANSPORT` (`auto`, `shm`, `unix`, `tcp`). A bad
//! value is an error naming the variable, never silently ignored. This
//! module must never read anything but these variables.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::error::CommError;
use crate::kinds::{Algorithm, DebugLevel, TransportKind};

/// Default time a collective may take before it fails: 10 minutes, as the
/// NCCL backend of PyTorch waits (gloo waits 30); a stopped or frozen worker
/// is found sooner by the launcher's worker heartbeat.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// Settings of one process group.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// Name used in errors and as the group's store namespace.
    pub name: String,
    /// How long any single operation (and the group's rendezvous) may take.
    pub timeout: Duration,
    /// Algorithm override; every rank must use the same.
    pub algorithm: Algorithm,
    /// Checking level.
    pub debug: DebugLevel,
    /// Address this rank listens on for its peers.
    pub bind_ip: IpAddr,
    /// Shared memory or sockets.
    pub transport: TransportKind,
}

impl Default for GroupOptions {
    /// Name `default`, 30-minute timeout, automatic algorithms, no extra
    /// checks, loopback; ignores the environment (see [`GroupOptions::from_env`]).
    fn default() -> Self {
        GroupOptions {
            name: "default".to_string(),
            timeout: DEFAULT_TIMEOUT,
            algorithm: Algorithm::Auto,
            debug: DebugLevel::Off,
            bind_ip: Ipv4Addr::LOCALHOST.into(),
            transport: TransportKind::Auto,
        }
    }
}

impl GroupOptions {
    /// The defaults overridden by `COHORT_TIMEOUT`, `COHORT_ALGO`,
    /// `COHORT_DEBUG`, `COHORT_TRANSPORT` and `COHORT_SOCKET_ADDR` where set.
    pub fn from_env() -> Result<GroupOptions, CommError> {
        let mut o = GroupOptions::default();
        if let Some(v) = var("COHORT_TIMEOUT")? {
            o.timeout = parse_duration(&v).ok_or_else(|| {
                bad(
                    "COHORT_TIMEOUT",
                    &v,
                    "a duration like 30, 1.5s, 500ms, 10m or 1h",
                )
            })?;
        }
        if let Some(v) = var("COHORT_ALGO")? {
            o.algorithm = Algorithm::parse(&v)
                .ok_or_else(|| bad("COHORT_ALGO", &v, "auto, ring, tree, shm or hierarchical"))?;
        }
        if let Some(v) = var("COHORT_DEBUG")? {
            o.debug = match v.to_ascii_lowercase().as_str() {
                "" | "off" | "0" | "info" => DebugLevel::Off,
                "detail" => DebugLevel::Detail,
                _ => return Err(bad("COHORT_DEBUG", &v, "off or detail")),
            };
        }
        if let Some(v) = var("COHORT_TRANSPORT")? {
            o.transport = TransportKind::parse(&v)
                .ok_or_else(|| bad("COHORT_TRANSPORT", &v, "auto, shm, unix or tcp"))?;
        }
        if let Some(v) = var("COHORT_SOCKET_ADDR")? {
            o.bind_ip = v
                .parse()
                .map_err(|_| bad("COHORT_SOCKET_ADDR", &v, "an IP address"))?;
        }
        Ok(o)
    }
}

/// Reads an environment variable; unset or empty is `None`, non-UTF-8 an error.
pub(crate) fn var(name: &str) -> Result<Option<String>, CommError> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_string())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(CommError::Init {
            name: name.to_string(),
            detail: "not valid UTF-8".to_string(),
        }),
    }
}

pub(crate) fn bad(name: &str, value: &str, expected: &str) -> CommError {
    CommError::Init {
        name: name.to_string(),
        detail: format!("{value:?} is not {expected}"),
    }
}

/// Parses `30`, `1.5`, `500ms`, `30s`, `10m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&s[..i], s[i..].trim()),
        None => (s, "s"),
    };
    let x: f64 = num.trim().parse().ok()?;
    let secs = match unit {
        "ms" => x / 1e3,
        "s" | "sec" => x,
        "m" | "min" => x * 60.0,
        "h" => x * 3600.0,
        _ => return None,
    };
    (secs.is_finite() && secs > 0.0).then(|| Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("10m"), Some(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0"), None);
        assert_eq!(parse_duration("soon"), None);
        assert_eq!(parse_duration("5y"), None);
    }
}

/// Arguments of [`init_process_group`](crate::init_process_group) beyond the backend and init method.
#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    /// This process's rank (overrides RANK or the URL's `rank`).
    pub rank: Option<usize>,
    /// Number of ranks (overrides WORLD_SIZE or the URL's `world_size`).
    pub world_size: Option<usize>,
    /// Group settings; `None` means [`GroupOptions::from_env`].
    pub group: Option<GroupOptions>,
}
