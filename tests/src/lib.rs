//! Helpers for the end-to-end tests (see tests/e2e_*.rs).
