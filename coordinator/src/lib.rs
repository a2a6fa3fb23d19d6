//! Baton coordinator: the OpenAI-compatible HTTP front, routing and stream checkpoints.
//!
//! The HTTP API, registry, router and checkpoint store are built on top of the worker
//! engine; this crate currently holds no behaviour of its own.
