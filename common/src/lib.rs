//! What crosses the wire between Baton's processes, and nothing else: ids, message
//! types, subject names, the token hash chain, configuration types.
//!
//! # Layout
//! - [`env`]: the names of every environment variable Baton reads.

#![deny(missing_docs)]

pub mod env;
