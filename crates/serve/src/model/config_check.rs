//! Reading a model's configuration fully checked: [`ModelConfig`]'s public constructors
//! (`from_pbtxt`, `from_toml`, `from_json`, `load`). The `config` module parses; then the
//! backend that will serve the model checks what only it can judge (through the backend seam,
//! `backend::check_config`, or the `ensemble` module for an ensemble); then `config` checks the
//! fields every model has. They live here, above both the backends and the ensemble, so that
//! `config` stays at the bottom of serving's imports. This module never loads a model.

use std::path::{Path, PathBuf};

use super::ensemble;
use crate::backend;
use crate::config::{config_err, Kind, ModelConfig};
use crate::error::ServeError;

impl ModelConfig {
    /// Parses and checks config.pbtxt text.
    pub fn from_pbtxt(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        ModelConfig::parse_pbtxt(text, path)?.checked(path)
    }

    /// Parses and checks config.toml text.
    pub fn from_toml(text: &str, path: &Path) -> Result<ModelConfig, ServeError> {
        ModelConfig::parse_toml(text, path)?.checked(path)
    }

    /// The configuration of the model in `dir`, checked: its config.pbtxt or config.toml, or
    /// the defaults when it has neither. Returns the file read, if any.
    pub fn load(dir: &Path) -> Result<(ModelConfig, Option<PathBuf>), ServeError> {
        match ModelConfig::read(dir)? {
            (cfg, Some(file)) => Ok((cfg.checked(&file)?, Some(file))),
            (cfg, None) => Ok((cfg, None)),
        }
    }

    /// Parses and checks a configuration given as JSON (Triton's `load_model(config=...)`), as
    /// Triton's clients write it: protobuf's JSON, where 64-bit integers may be strings. Unlike
    /// a config file, a field cohort would not use is an error, so that an override is never
    /// accepted and then silently not applied.
    pub fn from_json(text: &str, model: &str) -> Result<ModelConfig, ServeError> {
        let (cfg, path) = ModelConfig::parse_json(text, model)?;
        cfg.checked(&path)
    }

    /// Checks a parsed config: the backend it names, what that backend alone can judge, then
    /// the fields every model has (in that order, so a config with several faults is refused
    /// for the same one whichever way it came).
    fn checked(self, path: &Path) -> Result<ModelConfig, ServeError> {
        let kind = self.kind().map_err(|e| config_err(path, e))?;
        let by_backend = match kind {
            Kind::Ensemble => ensemble::check_config(&self),
            other => backend::check_config(other, &self),
        };
        by_backend.map_err(|e| config_err(path, e))?;
        self.check_fields(kind, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use cohort_gpt::sample::KvDtype;

    use crate::config::{VersionPolicy, PBTXT_FILE, TOML_FILE};

    #[test]
    fn pbtxt_and_toml_give_the_same_config() {
        let pbtxt = r#"
            name: "m"
            backend: "cohort"
            max_batch_size: 16
            dynamic_batching {
              preferred_batch_size: [ 4, 8 ]
              max_queue_delay_microseconds: 500
              default_queue_policy { max_queue_size: 7 }
            }
            instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 } ]
            version_policy: { latest: { num_versions: 2 } }
        "#;
        let toml = r#"
            name = "m"
            backend = "cohort"
            max_batch_size = 16
            [dynamic_batching]
            preferred_batch_size = [4, 8]
            max_queue_delay_microseconds = 500
            default_queue_policy = { max_queue_size = 7 }
            [[instance_group]]
            count = 2
            kind = "KIND_CPU"
            [[instance_group]]
            count = 1
            [version_policy]
            latest = { num_versions = 2 }
        "#;
        let a = ModelConfig::from_pbtxt(pbtxt, Path::new("config.pbtxt")).unwrap();
        let b = ModelConfig::from_toml(toml, Path::new("config.toml")).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.instance_count(), 3);
        assert_eq!(a.max_queue_delay(), Duration::from_micros(500));
        assert_eq!(a.max_queue_size(), Some(7));
        assert!(a.ignored_fields().is_empty());
        assert_eq!(a.kind(), Ok(Kind::Gpt));
        assert_eq!(a.version_policy, VersionPolicy::Latest { num_versions: 2 });
    }

    #[test]
    fn version_policies_select() {
        let present = [3, 1, 10, 2];
        assert_eq!(VersionPolicy::default().select(&present), [10]);
        assert_eq!(
            VersionPolicy::Latest { num_versions: 9 }.select(&present),
            [1, 2, 3, 10]
        );
        assert_eq!(VersionPolicy::All {}.select(&present), [1, 2, 3, 10]);
        assert_eq!(
            VersionPolicy::Specific {
                versions: vec![2, 4, 10]
            }
            .select(&present),
            [2, 10]
        );
        let p = ModelConfig::from_pbtxt(
            "version_policy { specific { versions: [1, 3] } }",
            Path::new("c"),
        )
        .unwrap();
        assert_eq!(
            p.version_policy,
            VersionPolicy::Specific {
                versions: vec![1, 3]
            }
        );
        let all = ModelConfig::from_pbtxt("version_policy { all { } }", Path::new("c")).unwrap();
        assert_eq!(all.version_policy, VersionPolicy::All {});
    }

    #[test]
    fn the_inflight_batching_parameter_reads_in_every_spelling() {
        let off = "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }";
        let p = ModelConfig::from_pbtxt(off, Path::new("c")).unwrap();
        assert!(!p.inflight_batching());
        let t = "[parameters]\ninflight_batching = \"false\"\n";
        assert_eq!(ModelConfig::from_toml(t, Path::new("c")).unwrap(), p);
        let j = r#"{"parameters": {"inflight_batching": {"string_value": "false"}}}"#;
        assert_eq!(ModelConfig::from_json(j, "m").unwrap(), p);
        assert!(ModelConfig::default().inflight_batching());
    }

    #[test]
    fn the_kv_cache_dtype_parameter_reads_in_every_spelling() {
        let bf16 = "parameters { key: \"kv_cache_dtype\" value: { string_value: \"bf16\" } }";
        let p = ModelConfig::from_pbtxt(bf16, Path::new("c")).unwrap();
        assert_eq!(p.kv_cache_dtype(), KvDtype::Bf16);
        let t = "[parameters]\nkv_cache_dtype = \"bf16\"\n";
        assert_eq!(ModelConfig::from_toml(t, Path::new("c")).unwrap(), p);
        let j = r#"{"parameters": {"kv_cache_dtype": {"string_value": "bf16"}}}"#;
        assert_eq!(ModelConfig::from_json(j, "m").unwrap(), p);
        let fp32 = "parameters { key: \"kv_cache_dtype\" value: { string_value: \"fp32\" } }";
        let p = ModelConfig::from_pbtxt(fp32, Path::new("c")).unwrap();
        assert_eq!(p.kv_cache_dtype(), KvDtype::F32);
        assert_eq!(ModelConfig::default().kv_cache_dtype(), KvDtype::F32);
        let budget = "parameters { key: \"max_prefill_tokens\" value: { string_value: \"96\" } }";
        let p = ModelConfig::from_pbtxt(budget, Path::new("c")).unwrap();
        assert_eq!(p.max_prefill_tokens(), Some(96));
        assert_eq!(ModelConfig::default().max_prefill_tokens(), None);
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        for (text, needle) in [
            ("max_batch_size: 0", "at least 1"),
            (
                "max_batch_size: 4 dynamic_batching { preferred_batch_size: 8 }",
                "preferred_batch_size 8",
            ),
            (
                "dynamic_batching { max_queue_delay_microsecond: 5 }",
                "max_queue_delay_microsecond",
            ),
            ("instance_group { kind: KIND_GPU }", "CPU only"),
            ("instance_group { count: 0 }", "at least 1"),
            ("version_policy { newest { } }", "newest"),
            ("max_batch_size: \"eight\"", "max_batch_size"),
            ("max_batch_size: 4 max_batch_size: 8", "max_batch_size"),
            ("max_batch_size 4", "line 1"),
            (
                "parameters { key: \"inflight_batching\" value: { string_value: \"no\" } }",
                "takes \"true\"",
            ),
            (
                "parameters { key: \"beam_width\" value: { string_value: \"4\" } }",
                "\"beam_width\" is not one cohort reads",
            ),
            ("parameters { key: \"inflight_batching\" }", "is not { key"),
            (
                "parameters { key: \"kv_cache_dtype\" value: { string_value: \"fp16\" } }",
                "parameter kv_cache_dtype is \"fp16\"; it takes \"fp32\" (the default) or \"bf16\"",
            ),
            (
                "parameters { key: \"max_prefill_tokens\" value: { string_value: \"0\" } }",
                "parameter max_prefill_tokens is \"0\"; it takes a positive integer",
            ),
        ] {
            let err = ModelConfig::from_pbtxt(text, Path::new("m/config.pbtxt")).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(needle) && msg.contains("m/config.pbtxt"),
                "{text}: {msg}"
            );
        }
    }

    #[test]
    fn a_directory_without_config_gets_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, file) = ModelConfig::load(dir.path()).unwrap();
        assert_eq!(cfg, ModelConfig::default());
        assert!(file.is_none());
        std::fs::write(dir.path().join(PBTXT_FILE), "max_batch_size: 2").unwrap();
        std::fs::write(dir.path().join(TOML_FILE), "max_batch_size = 2").unwrap();
        let err = ModelConfig::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("both"), "{err}");
    }

    #[test]
    fn input_and_output_sections_must_name_the_models_tensors() {
        let ok = r#"
            max_batch_size: 4
            input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
            output [
              { name: "logits" data_type: TYPE_FP32 dims: [ -1, 50257 ] },
              { name: "next_token" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } }
            ]
        "#;
        let cfg = ModelConfig::from_pbtxt(ok, Path::new("m/config.pbtxt")).unwrap();
        assert_eq!(cfg.input[0].name, "input_ids");
        assert_eq!(cfg.output.len(), 2);
        assert!(cfg.ignored_fields().is_empty());
        for (text, needle) in [
            (
                "input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] } ]",
                "input \"INPUT0\" is not a tensor of the model (it has input_ids)",
            ),
            (
                "output { name: \"probs\" }",
                "output \"probs\" is not a tensor",
            ),
            (
                "input { name: \"input_ids\" data_type: TYPE_INT32 }",
                "data_type TYPE_INT32; the model's is TYPE_INT64",
            ),
            (
                "output { name: \"logits\" dims: [ 3, 4, 5 ] }",
                "has dims [3, 4, 5]; the model's are [-1, -1]",
            ),
            (
                "input { name: \"input_ids\" format: FORMAT_NCHW }",
                "format",
            ),
            (
                "output [ { name: \"logits\" }, { name: \"logits\" } ]",
                "declared twice",
            ),
        ] {
            let err = ModelConfig::from_pbtxt(text, Path::new("m/config.pbtxt"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn a_json_override_is_read_as_triton_writes_it_and_refuses_what_it_cannot_honour() {
        let cfg = ModelConfig::from_json(
            r#"{"name": "m", "platform": "cohort_gpt", "max_batch_size": "2",
                "dynamic_batching": {"preferred_batch_size": [2],
                                     "max_queue_delay_microseconds": "1500"},
                "instance_group": [{"count": 3, "kind": "KIND_CPU"}]}"#,
            "m",
        )
        .unwrap();
        assert_eq!(cfg.max_batch_size, 2);
        assert_eq!(cfg.instance_count(), 3);
        assert_eq!(cfg.max_queue_delay(), Duration::from_micros(1500));
        for (text, needle) in [
            (
                r#"{"backend": "tensorflow"}"#,
                "backend \"tensorflow\" is not served by cohort",
            ),
            (
                r#"{"platform": "onnxruntime_onnx", "backend": "cohort"}"#,
                "name different backends",
            ),
            (r#"{"sequence_batching": {}}"#, "field sequence_batching"),
            (
                r#"{"instance_group": [{"count": 1, "gpus": [0]}]}"#,
                "field instance_group.gpus",
            ),
            (
                r#"{"dynamic_batching": {"default_queue_policy": {"timeout_action": 1}}}"#,
                "default_queue_policy.timeout_action",
            ),
            (r#"{"max_batch_size": 0}"#, "at least 1"),
            (r#"{"input": [{"name": "x"}]}"#, "input \"x\""),
            (r#"{"max_batch_size": "#, "JSON"),
        ] {
            let err = ModelConfig::from_json(text, "m").unwrap_err().to_string();
            assert!(
                err.contains(needle) && err.contains("config override of m"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn platform_and_backend_pick_the_backend_and_an_ensemble_is_checked() {
        let kind = |text: &str| ModelConfig::from_pbtxt(text, Path::new("c")).map(|c| c.kind());
        assert_eq!(kind("").unwrap(), Ok(Kind::Gpt));
        assert_eq!(
            kind("platform: \"onnxruntime_onnx\"").unwrap(),
            Ok(Kind::Onnx)
        );
        assert_eq!(kind("backend: \"onnxruntime\"").unwrap(), Ok(Kind::Onnx));
        let err = kind("platform: \"tensorrt_plan\"").unwrap_err().to_string();
        assert!(
            err.contains("platform \"tensorrt_plan\" is not served"),
            "{err}"
        );

        let ensemble = r#"
            platform: "ensemble"
            max_batch_size: 4
            input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 3 ] } ]
            output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
            ensemble_scheduling { step [
              { model_name: "b" input_map { key: "x" value: "mid" }
                output_map { key: "y" value: "OUT" } },
              { model_name: "a" model_version: 2 input_map { key: "x" value: "RAW" }
                output_map [ { key: "y" value: "mid" } ] }
            ] }
        "#;
        let cfg = ModelConfig::from_pbtxt(ensemble, Path::new("c")).unwrap();
        assert_eq!(cfg.kind(), Ok(Kind::Ensemble));
        let steps = &cfg.ensemble_scheduling.as_ref().unwrap().step;
        assert_eq!((steps[0].model_version, steps[1].model_version), (-1, 2));
        assert_eq!(steps[1].output_map["y"], "mid");
        for (edit, needle) in [
            (("value: \"RAW\"", "value: \"nothing\""), "can never run"),
            (
                ("value: \"OUT\"", "value: \"other\""),
                "output \"OUT\" is in no step",
            ),
            (
                ("data_type: TYPE_FP32 dims: [ 3 ]", "dims: [ 3 ]"),
                "needs a data_type",
            ),
            (
                ("value: \"mid\" } ] }", "value: \"OUT\" } ] }"),
                "produced twice",
            ),
        ] {
            let text = ensemble.replace(edit.0, edit.1);
            let err = ModelConfig::from_pbtxt(&text, Path::new("c"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{needle:?} not in {err}");
        }
    }
}
