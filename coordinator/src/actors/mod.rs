//! The coordinator's actors: the worker registry (with the router's choice) and the
//! stream sessions; [`messages`] holds every message they take.

pub mod affinity;
pub mod messages;
pub mod registry;
pub mod router;
pub mod sessions;
