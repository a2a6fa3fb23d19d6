//! The worker registry (with the router's choice, and the prompt prefixes it routes
//! by); [`messages`] holds the messages the registry and the sessions
//! ([`crate::sessions`]) take from the transport.

pub mod affinity;
pub mod messages;
pub mod registry;
pub mod router;
