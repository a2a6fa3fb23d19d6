//! The API as both fronts serve it (HTTP in [`crate::http`], NATS in [`crate::public`]):
//! requests validated into one shape, streams opened for them, answers read and shaped
//! as OpenAI's bodies, and one error kind. Nothing here knows a status code or a subject.
//!
//! - [`validate`]: request bodies into a [`validate::ValidRequest`].
//! - [`open`]: one stream per choice, handed to the sessions ([`open::open_streams`]).
//! - [`answer`]: reading an answer's updates (idle timeout, a long prompt's progress)
//!   and gathering whole answers.
//! - [`chunks`]: streamed chunks in OpenAI's shapes.
//! - [`choices`]: `n`: member streams, seeds, group event ids.
//! - [`openai`]: request and response bodies.
//! - [`logprobs`]: the `logprobs` objects of both endpoints.
//! - [`tokenize`]: `/tokenize` and `/detokenize`.
//! - [`models`]: an operator's model loads and unloads on a worker.
//! - [`error`]: [`error::ApiError`], OpenAI's error body and codes.

pub mod answer;
pub mod choices;
pub mod chunks;
pub mod error;
pub mod logprobs;
pub mod models;
pub mod open;
pub mod openai;
pub mod tokenize;
pub mod validate;
