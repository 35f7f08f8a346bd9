//! Where a worker finds the job's TCP store: the names of the variables and
//! which pair applies. A launcher that hosts the store names it with
//! `COHORT_STORE_ADDR` / `COHORT_STORE_PORT` and leaves `MASTER_ADDR` /
//! `MASTER_PORT` to programs that host their own store on rank 0 (a
//! torch.distributed script binds `MASTER_PORT` itself, and could not speak
//! this store's authenticated handshake anyway). Without the launcher's pair,
//! `MASTER_ADDR` / `MASTER_PORT` name the store, as in torch's `env://`.
//! This module only names variables; it never reads a value's meaning.

/// Address of a store a launcher hosts.
pub const STORE_ADDR_VAR: &str = "COHORT_STORE_ADDR";
/// Port of a store a launcher hosts.
pub const STORE_PORT_VAR: &str = "COHORT_STORE_PORT";

/// The (address, port) variable names that locate the store, given a lookup
/// of the environment: the launcher's pair when its address is set, else
/// `MASTER_ADDR` / `MASTER_PORT`.
pub fn store_vars(lookup: impl Fn(&str) -> Option<String>) -> (&'static str, &'static str) {
    match lookup(STORE_ADDR_VAR) {
        Some(addr) if !addr.trim().is_empty() => (STORE_ADDR_VAR, STORE_PORT_VAR),
        _ => ("MASTER_ADDR", "MASTER_PORT"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launchers_pair_wins_when_set_and_master_otherwise() {
        assert_eq!(store_vars(|_| None), ("MASTER_ADDR", "MASTER_PORT"));
        let set = |k: &str| (k == STORE_ADDR_VAR).then(|| "10.0.0.1".to_string());
        assert_eq!(store_vars(set), (STORE_ADDR_VAR, STORE_PORT_VAR));
        let empty = |k: &str| (k == STORE_ADDR_VAR).then(String::new);
        assert_eq!(store_vars(empty), ("MASTER_ADDR", "MASTER_PORT"));
    }
}
