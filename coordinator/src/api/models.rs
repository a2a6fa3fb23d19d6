//! Model loads and unloads on one worker, ordered by an operator over either front:
//! the order goes to the worker, which answers once the model serves (loaded beside
//! what runs, self-tested, switched to between two steps) or says why not, the models
//! it served before still serving.

use std::time::Duration;

use baton_common::{
    ids::WorkerId,
    protocol::{LoadModel, ModelReply},
    public::{LoadModelRequest, ModelsChanged, ServedModel},
};

use super::error::ApiError;
use crate::nats::NatsHandle;

/// How long a load may take: the file's SHA-256, the load and the self-test of a large
/// model from a slow disk.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// Orders `worker` to load the model `request` names.
pub async fn load(
    nats: &NatsHandle,
    worker: WorkerId,
    request: LoadModelRequest,
) -> Result<ModelsChanged, ApiError> {
    if request.path.trim().is_empty() {
        return Err(ApiError::invalid(
            "path",
            "`path` must name a GGUF file on the worker's host",
        ));
    }
    let order = LoadModel {
        path: request.path,
        sha256: request.sha256,
        name: request.name,
        add: request.add,
    };
    let reply = nats
        .load_model(worker, order, LOAD_TIMEOUT)
        .await
        .map_err(|e| ApiError::from_drain(worker, e))?;
    answer(reply, "path")
}

/// Orders `worker` to stop serving `model`; its streams finish on it.
pub async fn unload(
    nats: &NatsHandle,
    worker: WorkerId,
    model: String,
    timeout: Duration,
) -> Result<ModelsChanged, ApiError> {
    let reply = nats
        .unload_model(worker, model, timeout)
        .await
        .map_err(|e| ApiError::from_drain(worker, e))?;
    answer(reply, "model")
}

fn answer(reply: ModelReply, param: &'static str) -> Result<ModelsChanged, ApiError> {
    if let Some(error) = reply.error {
        return Err(ApiError::from_model_order(param, error));
    }
    Ok(ModelsChanged {
        worker: reply.worker,
        loaded: reply.loaded.as_ref().map(ServedModel::from),
        serving: reply.serving.iter().map(ServedModel::from).collect(),
        retiring_streams: reply.retiring_streams,
    })
}
