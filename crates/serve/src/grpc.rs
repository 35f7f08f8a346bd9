//! The gRPC front end: KServe v2's `inference.GRPCInferenceService` (the service Triton's gRPC
//! clients call) on tonic: liveness, readiness, server and model metadata, inference (typed
//! `contents` or `raw_input_contents` in; `raw_output_contents` out, as Triton answers), and the
//! repository index / load / unload. Errors are gRPC statuses mapped from [`ErrorKind`]. This
//! module never runs a model.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Code, Request, Response, Status};

use crate::error::{ErrorKind, ServeError};
use crate::proto::grpc_inference_service_server::GrpcInferenceService;
use crate::proto::{self, model_infer_response, model_metadata_response};
use crate::tensor::{self, single_input, InputData, Output, Wanted};
use crate::{metadata, AppState, SERVER_NAME};

/// The service over the shared state.
pub(crate) struct Service {
    pub app: Arc<AppState>,
}

fn status(e: ServeError) -> Status {
    let code = match e.kind() {
        ErrorKind::BadRequest => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::TooLarge => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    };
    Status::new(code, e.to_string())
}

fn opt(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn bool_param(
    params: &std::collections::HashMap<String, proto::InferParameter>,
    name: &str,
) -> Result<Option<bool>, ServeError> {
    use proto::infer_parameter::ParameterChoice;
    match params.get(name).and_then(|p| p.parameter_choice.as_ref()) {
        None => Ok(None),
        Some(ParameterChoice::BoolParam(b)) => Ok(Some(*b)),
        Some(other) => Err(ServeError::parameter(
            name,
            format!("{other:?} is not a boolean"),
        )),
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(
        &self,
        _: Request<proto::ServerLiveRequest>,
    ) -> Result<Response<proto::ServerLiveResponse>, Status> {
        Ok(Response::new(proto::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<proto::ServerReadyRequest>,
    ) -> Result<Response<proto::ServerReadyResponse>, Status> {
        Ok(Response::new(proto::ServerReadyResponse {
            ready: self.app.ready.load(Ordering::Acquire),
        }))
    }

    async fn model_ready(
        &self,
        req: Request<proto::ModelReadyRequest>,
    ) -> Result<Response<proto::ModelReadyResponse>, Status> {
        let r = req.into_inner();
        let ready = self.app.repo.resolve(&r.name, opt(&r.version)).is_ok();
        Ok(Response::new(proto::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<proto::ServerMetadataRequest>,
    ) -> Result<Response<proto::ServerMetadataResponse>, Status> {
        Ok(Response::new(proto::ServerMetadataResponse {
            name: SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: crate::EXTENSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<proto::ModelMetadataRequest>,
    ) -> Result<Response<proto::ModelMetadataResponse>, Status> {
        let r = req.into_inner();
        let lv = self
            .app
            .repo
            .resolve(&r.name, opt(&r.version))
            .map_err(status)?;
        let versions = match opt(&r.version) {
            Some(v) => vec![v.to_string()],
            None => self
                .app
                .repo
                .versions(&r.name)
                .map_err(status)?
                .iter()
                .map(u64::to_string)
                .collect(),
        };
        let m = metadata(&lv, versions);
        let tensors = |ts: Vec<crate::TensorMeta>| {
            ts.into_iter()
                .map(|t| model_metadata_response::TensorMetadata {
                    name: t.name.into(),
                    datatype: t.datatype.into(),
                    shape: t.shape,
                })
                .collect()
        };
        Ok(Response::new(proto::ModelMetadataResponse {
            name: m.name,
            versions: m.versions,
            platform: m.platform.into(),
            inputs: tensors(m.inputs),
            outputs: tensors(m.outputs),
        }))
    }

    async fn model_infer(
        &self,
        req: Request<proto::ModelInferRequest>,
    ) -> Result<Response<proto::ModelInferResponse>, Status> {
        let start = Instant::now();
        let r = req.into_inner();
        let lv = self
            .app
            .repo
            .resolve(&r.model_name, opt(&r.model_version))
            .map_err(status)?;
        let parsed = (|| {
            let input = single_input(&lv.model, &r.inputs)?;
            let data = match (r.raw_input_contents.first(), &input.contents) {
                (Some(_), Some(_)) => {
                    return Err(ServeError::malformed(format!(
                        "input {:?} has both contents and raw_input_contents",
                        input.name
                    )))
                }
                (Some(raw), None) => InputData::Raw(raw),
                (None, Some(c)) => InputData::Int64(&c.int64_contents),
                (None, None) => InputData::Int64(&[]),
            };
            if r.raw_input_contents.len() > 1 {
                return Err(ServeError::malformed(format!(
                    "{} raw_input_contents for 1 input",
                    r.raw_input_contents.len()
                )));
            }
            let batch = tensor::token_batch(
                &lv.model,
                lv.limits,
                &input.name,
                &input.datatype,
                &input.shape,
                data,
            )?;
            let outputs: Vec<Output> = if r.outputs.is_empty() {
                Output::ALL.to_vec()
            } else {
                r.outputs
                    .iter()
                    .map(|o| Output::parse(&lv.model, &o.name))
                    .collect::<Result<_, _>>()?
            };
            // Triton's binary-output parameter means nothing here (raw bytes always), but a
            // malformed one is still an error
            for o in &r.outputs {
                bool_param(&o.parameters, "binary_data")?;
            }
            Ok((batch, outputs))
        })();
        let (batch, outputs) = match parsed {
            Ok(x) => x,
            Err(e) => return Err(status(lv.reject(e, start))),
        };
        let want = Wanted {
            logits: outputs.contains(&Output::Logits),
            next_token: outputs.contains(&Output::NextToken),
        };
        let result = lv.infer(batch, want).await.map_err(status)?;
        let mut resp = proto::ModelInferResponse {
            model_name: lv.model.clone(),
            model_version: lv.version.to_string(),
            id: r.id,
            ..Default::default()
        };
        for o in outputs {
            resp.outputs.push(model_infer_response::InferOutputTensor {
                name: o.name().into(),
                datatype: o.datatype().into(),
                shape: result.shape(o),
                ..Default::default()
            });
            resp.raw_output_contents.push(result.le_bytes(o));
        }
        Ok(Response::new(resp))
    }

    async fn repository_index(
        &self,
        req: Request<proto::RepositoryIndexRequest>,
    ) -> Result<Response<proto::RepositoryIndexResponse>, Status> {
        let r = req.into_inner();
        let models = self
            .app
            .repo
            .index(r.ready)
            .into_iter()
            .map(|e| proto::repository_index_response::ModelIndex {
                name: e.name,
                version: e.version,
                state: e.state,
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(proto::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        req: Request<proto::RepositoryModelLoadRequest>,
    ) -> Result<Response<proto::RepositoryModelLoadResponse>, Status> {
        let name = req.into_inner().model_name;
        let repo = self.app.repo.clone();
        tokio::task::spawn_blocking(move || repo.load(&name))
            .await
            .map_err(|e| Status::internal(format!("load task failed: {e}")))?
            .map_err(status)?;
        Ok(Response::new(proto::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        req: Request<proto::RepositoryModelUnloadRequest>,
    ) -> Result<Response<proto::RepositoryModelUnloadResponse>, Status> {
        let name = req.into_inner().model_name;
        let repo = self.app.repo.clone();
        tokio::task::spawn_blocking(move || repo.unload(&name))
            .await
            .map_err(|e| Status::internal(format!("unload task failed: {e}")))?
            .map_err(status)?;
        Ok(Response::new(proto::RepositoryModelUnloadResponse {}))
    }
}
