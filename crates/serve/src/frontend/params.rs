//! The request parameters both KServe front ends (HTTP and gRPC) read the same way: a generate
//! request's sampling options and a repository load's parameters. This module never reads a
//! body or a message; it is handed the parameters already parsed.

use cohort_gpt::sample::SampleOptions;
use serde_json::{Map, Value};

use crate::error::ServeError;
use crate::MAX_GENERATE_TOKENS;

/// A repository load parameter cohort does not take, refused by name (never ignored: an
/// ignored parameter would load something other than what the caller asked for).
pub(crate) fn unsupported_load_parameter(name: &str) -> ServeError {
    let why = if name.starts_with("file:") {
        "override files are not supported; put the checkpoint in the repository's version \
         directory and pass the configuration as the config parameter"
    } else {
        "unknown; load takes config (a JSON model configuration)"
    };
    ServeError::parameter(name, why)
}

/// A generate request's parameters.
pub(crate) struct GenerateOptions {
    pub opts: SampleOptions,
    /// The prompt is left out of `text_output`.
    pub exclude_input: bool,
    /// vLLM's `ignore_eos`: generate past the model's end of text.
    pub ignore_eos: bool,
}

/// The sampling options of a generate request's parameters, with `cohort sample`'s defaults
/// (100 tokens, temperature 0.8, no top-k, seed 1337).
pub(crate) fn generate_options(
    params: &Map<String, Value>,
    streaming: bool,
) -> Result<GenerateOptions, ServeError> {
    let mut opts = SampleOptions {
        max_new_tokens: 100,
        temperature: 0.8,
        top_k: None,
        top_p: 1.0,
        seed: 1337,
    };
    let (mut exclude_input, mut ignore_eos) = (false, false);
    for (k, v) in params {
        let int = || {
            v.as_i64()
                .ok_or_else(|| ServeError::parameter(k, format!("{v} is not an integer")))
        };
        match k.as_str() {
            "max_tokens" => {
                let n = int()?;
                if n < 1 || n as usize > MAX_GENERATE_TOKENS {
                    return Err(ServeError::parameter(
                        k,
                        format!("{n} is outside 1..={MAX_GENERATE_TOKENS}"),
                    ));
                }
                opts.max_new_tokens = n as usize;
            }
            "temperature" => {
                let t = v
                    .as_f64()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a number")))?;
                if !(t >= 0.0 && t.is_finite()) {
                    return Err(ServeError::parameter(
                        k,
                        format!("{t} must be >= 0 (0 = greedy)"),
                    ));
                }
                opts.temperature = t as f32;
            }
            "top_p" => {
                let p = v
                    .as_f64()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not in 0..=1")))?;
                opts.top_p = p as f32;
            }
            // 0 and -1 mean "no top-k", as Hugging Face's and vLLM's conventions
            "top_k" => opts.top_k = usize::try_from(int()?).ok().filter(|&k| k > 0),
            "seed" => {
                opts.seed = v
                    .as_u64()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a u64")))?
            }
            "exclude_input_in_output" => {
                exclude_input = v
                    .as_bool()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a boolean")))?
            }
            "ignore_eos" => {
                ignore_eos = v
                    .as_bool()
                    .ok_or_else(|| ServeError::parameter(k, format!("{v} is not a boolean")))?
            }
            "stream" => {
                if v.as_bool() != Some(streaming) {
                    return Err(ServeError::parameter(
                        k,
                        format!(
                            "{v} does not match the endpoint (generate_stream streams, generate \
                             does not)"
                        ),
                    ));
                }
            }
            _ => {
                return Err(ServeError::parameter(
                    k,
                    "unknown; generate takes max_tokens, temperature, top_k, top_p, seed, \
                     ignore_eos, exclude_input_in_output, stream",
                ))
            }
        }
    }
    Ok(GenerateOptions {
        opts,
        exclude_input,
        ignore_eos,
    })
}
