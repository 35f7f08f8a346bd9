//! What the server says about a model, one source for both KServe protocols: its metadata
//! (name, versions, platform, tensors) and the configuration it is served with, as Triton's
//! `ModelConfig` message (gRPC's answer) and that message's JSON (HTTP's `/config`), so the two
//! protocols always agree. This module never changes a model or its config; it only describes
//! what is loaded.

use serde_json::{json, Map, Value};

use crate::config::VersionPolicy;
use crate::model::LoadedVersion;
use crate::proto;
use crate::tensor::{self, TensorSpec};

/// Model metadata, shared by the HTTP and gRPC answers.
pub(crate) struct ModelMeta<'a> {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: &'static str,
    pub inputs: &'a [TensorSpec],
    pub outputs: &'a [TensorSpec],
}

pub(crate) fn metadata(lv: &LoadedVersion, versions: Vec<String>) -> ModelMeta<'_> {
    ModelMeta {
        name: lv.model.clone(),
        versions,
        platform: lv.kind.platform(),
        inputs: lv.inputs(),
        outputs: lv.outputs(),
    }
}

/// The configuration `lv` is served with, as Triton's ModelConfig: what the config file (or a
/// load override) says, with Triton's effective defaults filled in (the tensors, CPU instance
/// groups). The HTTP `/config` answer is [`config_json`] of the same message, so both protocols
/// always agree.
pub(crate) fn served_config(lv: &LoadedVersion) -> proto::ModelConfig {
    use proto::model_config::SchedulingChoice;
    use proto::model_instance_group::Kind;
    use proto::model_version_policy::{self as vp, PolicyChoice};
    use proto::DataType;
    use tensor::DataType as Dt;
    let cfg = &lv.config;
    let policy = match &cfg.version_policy {
        VersionPolicy::Latest { num_versions } => PolicyChoice::Latest(vp::Latest {
            num_versions: *num_versions,
        }),
        VersionPolicy::All {} => PolicyChoice::All(vp::All {}),
        VersionPolicy::Specific { versions } => PolicyChoice::Specific(vp::Specific {
            versions: versions.iter().map(|&v| v as i64).collect(),
        }),
    };
    let counts: Vec<usize> = if cfg.instance_group.is_empty() {
        vec![1]
    } else {
        cfg.instance_group.iter().map(|g| g.count).collect()
    };
    let dtype = |d: Dt| DataType::from_str_name(d.triton()).unwrap_or(DataType::TypeInvalid) as i32;
    // without the batch dimension, as Triton writes a batching model's tensors; a tensor with
    // no other dimension is [1] reshaped to []
    let reshape =
        |t: &TensorSpec| (t.shape.len() == 1).then(|| proto::ModelTensorReshape { shape: vec![] });
    proto::ModelConfig {
        name: lv.model.clone(),
        platform: lv.kind.platform().into(),
        backend: lv.kind.backend().into(),
        version_policy: Some(proto::ModelVersionPolicy {
            policy_choice: Some(policy),
        }),
        max_batch_size: cfg.max_batch_size as i32,
        input: lv
            .inputs()
            .iter()
            .map(|t| proto::ModelInput {
                name: t.name.clone(),
                data_type: dtype(t.datatype),
                dims: t.config_dims(),
            })
            .collect(),
        output: lv
            .outputs()
            .iter()
            .map(|t| proto::ModelOutput {
                name: t.name.clone(),
                data_type: dtype(t.datatype),
                dims: t.config_dims(),
                reshape: reshape(t),
            })
            .collect(),
        scheduling_choice: cfg.dynamic_batching.as_ref().map(|d| {
            SchedulingChoice::DynamicBatching(proto::ModelDynamicBatching {
                preferred_batch_size: d.preferred_batch_size.iter().map(|&p| p as i32).collect(),
                max_queue_delay_microseconds: d.max_queue_delay_microseconds,
                preserve_ordering: d.preserve_ordering,
                default_queue_policy: d.default_queue_policy.as_ref().map(|q| {
                    proto::ModelQueuePolicy {
                        max_queue_size: q.max_queue_size as u32,
                    }
                }),
            })
        }),
        instance_group: counts
            .iter()
            .enumerate()
            .map(|(i, &count)| proto::ModelInstanceGroup {
                name: format!("{}_{i}", lv.model),
                kind: Kind::Cpu as i32,
                count: count as i32,
            })
            .collect(),
        parameters: cfg
            .parameters
            .iter()
            .map(|(k, v)| {
                let p = proto::ModelParameter {
                    string_value: v.clone(),
                };
                (k.clone(), p)
            })
            .collect(),
    }
}

/// Triton's HTTP JSON of a ModelConfig: the message's fields by their proto names.
pub(crate) fn config_json(c: &proto::ModelConfig) -> Value {
    use proto::model_config::SchedulingChoice;
    use proto::model_version_policy::PolicyChoice;
    let dtype = |t: i32| {
        proto::DataType::try_from(t)
            .unwrap_or(proto::DataType::TypeInvalid)
            .as_str_name()
    };
    let policy = match c
        .version_policy
        .as_ref()
        .and_then(|p| p.policy_choice.as_ref())
    {
        Some(PolicyChoice::Latest(l)) => json!({"latest": {"num_versions": l.num_versions}}),
        Some(PolicyChoice::All(_)) => json!({"all": {}}),
        Some(PolicyChoice::Specific(s)) => json!({"specific": {"versions": s.versions}}),
        None => json!({}),
    };
    let mut v = json!({
        "name": c.name,
        "platform": c.platform,
        "backend": c.backend,
        "version_policy": policy,
        "max_batch_size": c.max_batch_size,
        "input": c.input.iter().map(|t| json!({
            "name": t.name, "data_type": dtype(t.data_type), "dims": t.dims,
        })).collect::<Vec<_>>(),
        "output": c.output.iter().map(|t| {
            let mut o = json!({"name": t.name, "data_type": dtype(t.data_type), "dims": t.dims});
            if let Some(r) = &t.reshape {
                o["reshape"] = json!({"shape": r.shape});
            }
            o
        }).collect::<Vec<_>>(),
        "instance_group": c.instance_group.iter().map(|g| json!({
            "name": g.name,
            "kind": proto::model_instance_group::Kind::try_from(g.kind)
                .unwrap_or(proto::model_instance_group::Kind::Auto)
                .as_str_name(),
            "count": g.count,
        })).collect::<Vec<_>>(),
    });
    if let Some(SchedulingChoice::DynamicBatching(d)) = &c.scheduling_choice {
        let mut db = json!({
            "preferred_batch_size": d.preferred_batch_size,
            "max_queue_delay_microseconds": d.max_queue_delay_microseconds,
            "preserve_ordering": d.preserve_ordering,
        });
        if let Some(q) = &d.default_queue_policy {
            db["default_queue_policy"] = json!({"max_queue_size": q.max_queue_size});
        }
        v["dynamic_batching"] = db;
    }
    if !c.parameters.is_empty() {
        let p: Map<String, Value> = c
            .parameters
            .iter()
            .map(|(k, p)| (k.clone(), json!({ "string_value": p.string_value })))
            .collect();
        v["parameters"] = Value::Object(p);
    }
    v
}
