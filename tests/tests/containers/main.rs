//! Container suite (in progress).
