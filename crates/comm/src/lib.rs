//! Collective communication (c10d's role): process groups, a TCP backend, every collective.
