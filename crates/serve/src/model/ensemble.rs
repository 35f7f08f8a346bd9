//! Ensembles (`platform: "ensemble"`), as Triton's: a model whose config lists steps, each
//! executing another loaded model; `input_map` feeds a step's inputs from ensemble tensors (the
//! ensemble's inputs or earlier steps' outputs), `output_map` names the ensemble tensors its
//! outputs become, and the ensemble's outputs are some of those. The config declares the
//! ensemble's inputs and outputs with their types and dims (there is no model file).
//!
//! A step goes through its model's own queue, batcher and instances, so dynamic batching
//! applies per step and each step's model counts the request in its own statistics (Triton's
//! per-composing-model statistics); the ensemble's statistics count whole requests. A step
//! resolves its model when the request runs (version -1: the newest ready), so a step model
//! can be reloaded without reloading the ensemble. Steps run one after another in an order
//! where each step's inputs exist. A step's model may itself be an ensemble (nested, as
//! Triton's): its steps run the same way and every model on the way counts the request. An
//! ensemble must never reach itself through its steps: [`cycle`] finds such a loop, which the
//! repository refuses at load from the configs it knows, and which a request is refused on
//! if one slips past that (a step resolved at run time, a config reloaded since), naming the
//! loop rather than recursing forever. A step that fails answers for the ensemble, named: a
//! request its model refuses (text a tokenizer step cannot encode, say) is still a bad request.
//! This module never parses requests off the wire.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;

use super::Models;
use crate::config::{EnsembleStep, Kind, ModelConfig, TensorConfig};
use crate::error::ServeError;
use crate::tensor::{
    self, DataType, InferResult, InputData, Request, Tensor, TensorSpec, WireInput,
};

/// A loaded ensemble: its tensors and its steps in execution order.
pub(crate) struct Ensemble {
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    steps: Vec<EnsembleStep>,
}

/// The specs a config section declares (the batch dimension added first).
fn specs(section: &str, entries: &[TensorConfig]) -> Result<Vec<TensorSpec>, String> {
    let mut out = Vec::with_capacity(entries.len());
    for t in entries {
        let dt = t.data_type.as_deref().ok_or_else(|| {
            format!(
                "ensemble {section} {:?} needs a data_type (an ensemble has no model file to \
                 read it from)",
                t.name
            )
        })?;
        let datatype = DataType::from_triton(dt).ok_or_else(|| {
            format!(
                "ensemble {section} {:?} has data_type {dt}, which cohort does not serve (it \
                 serves {})",
                t.name,
                DataType::ALL.map(DataType::triton).join(", ")
            )
        })?;
        if out.iter().any(|s: &TensorSpec| s.name == t.name) {
            return Err(format!("ensemble {section} {:?} is declared twice", t.name));
        }
        let mut shape = vec![-1];
        shape.extend_from_slice(&t.dims);
        out.push(TensorSpec {
            name: t.name.clone(),
            datatype,
            shape,
        });
    }
    if out.is_empty() {
        return Err(format!("an ensemble must declare its {section}s"));
    }
    Ok(out)
}

/// The steps of `cfg` in an order where every step's inputs exist before it runs, checking
/// that every tensor is produced once and every ensemble output is produced.
fn order(
    cfg: &ModelConfig,
    inputs: &[TensorSpec],
    outputs: &[TensorSpec],
) -> Result<Vec<EnsembleStep>, String> {
    let steps = cfg
        .ensemble_scheduling
        .as_ref()
        .map(|e| e.step.clone())
        .unwrap_or_default();
    if steps.is_empty() {
        return Err(
            "platform \"ensemble\" needs ensemble_scheduling with at least one step".into(),
        );
    }
    let mut produced: BTreeMap<&str, String> = BTreeMap::new();
    for s in inputs {
        produced.insert(&s.name, "the ensemble's input".into());
    }
    for (i, step) in steps.iter().enumerate() {
        if step.model_name.is_empty() {
            return Err(format!("step {i} names no model_name"));
        }
        if step.input_map.is_empty() {
            return Err(format!("step {i} ({:?}) has no input_map", step.model_name));
        }
        for tensor in step.output_map.values() {
            let by = format!("step {i} ({:?})", step.model_name);
            if let Some(first) = produced.insert(tensor, by.clone()) {
                return Err(format!(
                    "ensemble tensor {tensor:?} is produced twice: by {first} and by {by}"
                ));
            }
        }
    }
    for o in outputs {
        if !produced.contains_key(o.name.as_str()) {
            return Err(format!(
                "ensemble output {:?} is in no step's output_map",
                o.name
            ));
        }
    }
    let mut available: BTreeSet<&str> = inputs.iter().map(|s| s.name.as_str()).collect();
    let mut left: Vec<(usize, &EnsembleStep)> = steps.iter().enumerate().collect();
    let mut ordered = Vec::with_capacity(steps.len());
    while !left.is_empty() {
        let Some(pos) = left
            .iter()
            .position(|(_, s)| s.input_map.values().all(|t| available.contains(t.as_str())))
        else {
            let (i, s) = left[0];
            let missing = s
                .input_map
                .iter()
                .find(|(_, t)| !available.contains(t.as_str()))
                .map(|(input, t)| format!("input {input:?} is fed ensemble tensor {t:?}"))
                .unwrap_or_default();
            return Err(format!(
                "step {i} ({:?}) can never run: {missing}, which no ensemble input or other \
                 step produces (or the steps feed each other in a cycle)",
                s.model_name
            ));
        };
        let (_, step) = left.remove(pos);
        available.extend(step.output_map.values().map(String::as_str));
        ordered.push(step.clone());
    }
    Ok(ordered)
}

/// The models `cfg`'s steps name, in step order.
pub(crate) fn step_models(cfg: &ModelConfig) -> Vec<&str> {
    cfg.ensemble_scheduling
        .as_ref()
        .map(|e| e.step.iter().map(|s| s.model_name.as_str()).collect())
        .unwrap_or_default()
}

/// The loop `model` closes when it is entered from inside the ensembles `chain` (outermost
/// first), written `a -> b -> a`; None when it is not in the chain.
pub(crate) fn cycle(chain: &[&str], model: &str) -> Option<String> {
    let at = chain.iter().position(|&m| m == model)?;
    let mut names = chain[at..].to_vec();
    names.push(model);
    Some(names.join(" -> "))
}

/// A loop through `model`'s steps back to itself, following the steps of the ensembles
/// `config_of` knows (it answers None for a model that is not an ensemble or not known);
/// None when there is none.
pub(crate) fn load_cycle<'c>(
    model: &'c str,
    cfg: &'c ModelConfig,
    config_of: &dyn Fn(&str) -> Option<&'c ModelConfig>,
) -> Option<String> {
    fn walk<'c>(
        chain: &mut Vec<&'c str>,
        seen: &mut BTreeSet<&'c str>,
        cfg: &'c ModelConfig,
        config_of: &dyn Fn(&str) -> Option<&'c ModelConfig>,
    ) -> Option<String> {
        for step in step_models(cfg) {
            // only a loop back to where the walk started is this model's; a loop among
            // other models is theirs to be refused for
            if step == chain[0] {
                return cycle(chain, step);
            }
            if !seen.insert(step) {
                continue;
            }
            if let Some(inner) = config_of(step) {
                chain.push(step);
                if let Some(c) = walk(chain, seen, inner, config_of) {
                    return Some(c);
                }
                chain.pop();
            }
        }
        None
    }
    walk(&mut vec![model], &mut BTreeSet::new(), cfg, config_of)
}

/// Checks an ensemble's config without loading anything.
pub(crate) fn check_config(cfg: &ModelConfig) -> Result<(), String> {
    Ensemble::new(cfg).map(|_| ())
}

impl Ensemble {
    /// The ensemble `cfg` describes.
    pub fn new(cfg: &ModelConfig) -> Result<Ensemble, String> {
        let inputs = specs("input", &cfg.input)?;
        let outputs = specs("output", &cfg.output)?;
        let steps = order(cfg, &inputs, &outputs)?;
        Ok(Ensemble {
            inputs,
            outputs,
            steps,
        })
    }

    /// Runs a checked request through the steps, resolving their models in `repo`, and
    /// returns the outputs `want` (indices into the ensemble's outputs), or why a step failed
    /// (the step's own error inside, so a request at fault is still a bad request). `me` is
    /// the ensemble's name and version, for errors; `via` the ensembles the request is
    /// already inside, outermost first. (Boxed: a step may run an ensemble, so the future
    /// contains itself.)
    pub fn run<'a>(
        &'a self,
        repo: &'a dyn Models,
        request: Request,
        want: &'a [usize],
        me: (&'a str, u64),
        via: &'a [&'a str],
    ) -> Pin<Box<dyn Future<Output = Result<InferResult, ServeError>> + Send + 'a>> {
        Box::pin(self.run_steps(repo, request, want, me, via))
    }

    async fn run_steps(
        &self,
        repo: &dyn Models,
        request: Request,
        want: &[usize],
        (model, version): (&str, u64),
        via: &[&str],
    ) -> Result<InferResult, ServeError> {
        let mut chain = via.to_vec();
        chain.push(model);
        let mut values: BTreeMap<String, Tensor> = self
            .inputs
            .iter()
            .map(|s| s.name.clone())
            .zip(request.inputs)
            .collect();
        for step in &self.steps {
            self.run_step(repo, step, &mut values, &chain)
                .await
                .map_err(|e| ServeError::Step {
                    model: model.to_string(),
                    version,
                    step: step.model_name.clone(),
                    source: Box::new(e),
                })?;
        }
        let failed = |reason: String| ServeError::Execution {
            model: model.to_string(),
            version,
            reason,
        };
        want.iter()
            .map(|&o| {
                let spec = &self.outputs[o];
                let t = values
                    .get(&spec.name)
                    .ok_or_else(|| failed(format!("no step produced output {:?}", spec.name)))?;
                if t.datatype != spec.datatype {
                    return Err(failed(format!(
                        "output {:?} is {} from its step; the ensemble declares {}",
                        spec.name, t.datatype, spec.datatype
                    )));
                }
                Ok((spec.name.clone(), t.clone()))
            })
            .collect()
    }

    /// One step: its model's inputs from `values`, its mapped outputs into `values`.
    async fn run_step(
        &self,
        repo: &dyn Models,
        step: &EnsembleStep,
        values: &mut BTreeMap<String, Tensor>,
        chain: &[&str],
    ) -> Result<(), ServeError> {
        let version = (step.model_version >= 0).then(|| step.model_version.to_string());
        let lv = repo.resolve(&step.model_name, version.as_deref())?;
        if lv.kind == Kind::Ensemble {
            if let Some(loop_) = cycle(chain, &lv.model) {
                return Err(ServeError::Execution {
                    model: lv.model.clone(),
                    version: lv.version,
                    reason: format!("ensembles reach themselves through their steps: {loop_}"),
                });
            }
        }
        let mut shapes = Vec::with_capacity(lv.inputs().len());
        let mut feeds = Vec::with_capacity(lv.inputs().len());
        for spec in lv.inputs() {
            let tensor = step.input_map.get(&spec.name).ok_or_else(|| {
                ServeError::malformed(format!(
                    "the step's input_map feeds nothing to its model's input {:?}",
                    spec.name
                ))
            })?;
            let t = values.get(tensor).ok_or_else(|| {
                ServeError::malformed(format!("ensemble tensor {tensor:?} has no value"))
            })?;
            shapes.push(t.wire_shape());
            feeds.push((spec.name.as_str(), t));
        }
        if let Some(extra) = step
            .input_map
            .keys()
            .find(|k| !lv.inputs().iter().any(|s| &s.name == *k))
        {
            return Err(ServeError::UnknownTensor {
                model: lv.model.clone(),
                direction: "input",
                name: extra.clone(),
                known: tensor::names(lv.inputs()),
            });
        }
        let wire = feeds
            .iter()
            .zip(&shapes)
            .map(|((name, t), shape)| WireInput {
                name,
                datatype: t.datatype.name(),
                shape,
                data: InputData::Raw(&t.data),
            })
            .collect();
        let req = tensor::request(&lv.model, lv.inputs(), lv.config.max_batch_size, wire)?;
        lv.check(&req)?;
        let want = tensor::wanted_outputs(
            &lv.model,
            lv.outputs(),
            step.output_map.keys().map(String::as_str),
        )?;
        for (name, t) in lv.infer_via(repo, req, want, chain).await? {
            if let Some(tensor) = step.output_map.get(&name) {
                values.insert(tensor.clone(), t);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn ens(steps: &[&str]) -> ModelConfig {
        // step k reads t{k} (the input i first) and writes t{k+1} (the output o last)
        let tensor = |k: usize| match k {
            0 => "i".to_string(),
            k if k == steps.len() => "o".to_string(),
            k => format!("t{k}"),
        };
        let steps: Vec<String> = steps
            .iter()
            .enumerate()
            .map(|(k, m)| {
                format!(
                    "{{ model_name: \"{m}\" input_map {{ key: \"i\" value: \"{}\" }} \
                     output_map {{ key: \"o\" value: \"{}\" }} }}",
                    tensor(k),
                    tensor(k + 1)
                )
            })
            .collect();
        let text = format!(
            "platform: \"ensemble\"\n\
             input [ {{ name: \"i\" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n\
             output [ {{ name: \"o\" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n\
             ensemble_scheduling {{ step [ {} ] }}\n",
            steps.join(", ")
        );
        ModelConfig::from_pbtxt(&text, Path::new("config.pbtxt")).unwrap()
    }

    #[test]
    fn a_loop_is_named_from_where_it_closes() {
        assert_eq!(cycle(&["x", "a", "b"], "a").as_deref(), Some("a -> b -> a"));
        assert_eq!(cycle(&["a"], "a").as_deref(), Some("a -> a"));
        assert_eq!(cycle(&["a", "b"], "c"), None);
        assert_eq!(cycle(&[], "a"), None);
    }

    #[test]
    fn load_finds_a_loop_back_to_the_model_through_known_ensembles_only() {
        let configs: BTreeMap<&str, ModelConfig> = [
            ("b", ens(&["onnx", "c"])),
            ("c", ens(&["d", "a"])),
            ("d", ens(&["onnx"])),
            ("e", ens(&["f"])),
            ("f", ens(&["e"])),
        ]
        .into_iter()
        .collect();
        let config_of = |m: &str| configs.get(m);
        let a = ens(&["x", "b"]);
        assert_eq!(
            load_cycle("a", &a, &config_of).as_deref(),
            Some("a -> b -> c -> a")
        );
        let (s, g) = (ens(&["s"]), ens(&["e", "d"]));
        assert_eq!(load_cycle("s", &s, &config_of).as_deref(), Some("s -> s"));
        // a loop among others (e <-> f) is not this model's, and the walk still ends
        assert_eq!(load_cycle("g", &g, &config_of), None);
        // unknown models (not loaded yet) are not followed
        assert_eq!(load_cycle("a", &a, &|_| None), None);
    }
}
