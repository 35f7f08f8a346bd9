//! The job secret: where each launch gets it, and the rule for a launch
//! that has none.
//!
//! In order: [`LaunchConfig::secret`] (`cohort run --secret HEX` or
//! `--secret-file PATH`), then `COHORT_SECRET` in the launcher's
//! environment. Failing both, a single-node job gets a fresh secret from the
//! OS random generator (nobody else needs to know it). A multi-node job
//! cannot make one up, since every agent must hold the same: on a loopback
//! master address (all agents on this host, as in tests) it runs without
//! authentication, as torchrun always does, and says so; on any other
//! address, where the store listens on the network, it refuses to start.
//! The secret reaches the workers only through their environment, never a
//! command line or a log line.

use cohort_store::auth::{Secret, SECRET_ENV};

use crate::output::note;
use crate::{LaunchConfig, LaunchError};

/// The secret this agent's store, clients and workers use; `None` only for
/// a multi-node job on loopback that was given none.
pub(crate) fn job_secret(config: &LaunchConfig) -> Result<Option<Secret>, LaunchError> {
    if let Some(secret) = &config.secret {
        return Ok(Some(secret.clone()));
    }
    if let Some(secret) = Secret::from_env().map_err(|e| LaunchError::Config(e.to_string()))? {
        return Ok(Some(secret));
    }
    if config.nnodes == 1 {
        let secret = Secret::generate().map_err(|e| LaunchError::Config(e.to_string()))?;
        return Ok(Some(secret));
    }
    if is_loopback(&config.master_addr) {
        note(&format!(
            "no job secret given (--secret-file PATH, --secret HEX or {SECRET_ENV}): this \
             multi-node job runs without authentication, and any process on this host can \
             reach its store and sockets"
        ));
        return Ok(None);
    }
    Err(LaunchError::Config(format!(
        "a multi-node job needs a job secret shared by every node, so that no stranger can \
         join it through {}: give every node the same 64 hex characters with \
         --secret-file PATH, --secret HEX or {SECRET_ENV} (make one with \
         `openssl rand -hex 32`)",
        config.master_addr
    )))
}

fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(nnodes: usize, master_addr: &str) -> LaunchConfig {
        let mut c = LaunchConfig::new("true", vec![]);
        c.nnodes = nnodes;
        c.master_addr = master_addr.to_string();
        c
    }

    // These tests never set COHORT_SECRET themselves; where the developer's
    // environment has one, the cases that depend on its absence are skipped.
    fn env_has_secret() -> bool {
        std::env::var_os(SECRET_ENV).is_some_and(|v| !v.is_empty())
    }

    #[test]
    fn a_given_secret_wins_and_single_node_jobs_make_their_own() {
        let given = Secret::generate().unwrap();
        let mut c = config(2, "10.0.0.1");
        c.secret = Some(given.clone());
        assert_eq!(job_secret(&c).unwrap().unwrap().to_hex(), given.to_hex());
        if env_has_secret() {
            return;
        }
        let a = job_secret(&config(1, "127.0.0.1")).unwrap().unwrap();
        let b = job_secret(&config(1, "127.0.0.1")).unwrap().unwrap();
        assert_ne!(a.to_hex(), b.to_hex());
    }

    #[test]
    fn multi_node_without_a_secret_runs_open_on_loopback_and_refuses_elsewhere() {
        if env_has_secret() {
            return;
        }
        assert!(job_secret(&config(2, "127.0.0.1")).unwrap().is_none());
        assert!(job_secret(&config(2, "localhost")).unwrap().is_none());
        let err = job_secret(&config(2, "10.0.0.1")).unwrap_err().to_string();
        assert!(
            err.contains("--secret-file") && err.contains(SECRET_ENV) && err.contains("10.0.0.1"),
            "{err}"
        );
    }
}
