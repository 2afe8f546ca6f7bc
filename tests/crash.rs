//! Crash consistency: a writer killed with SIGKILL loses no acknowledged object.
