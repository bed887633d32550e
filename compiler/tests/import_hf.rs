//! `schedc import hf` (issue 28, item 1): Hugging Face configs of the GPT-2, LLaMA and Mistral
//! families become model blocks whose parameter count is the published checkpoint's, and every
//! config the language cannot express is refused naming its field.
//!
//! The configs in `tests/hf/` are those of the public checkpoints (`gpt2`, `gpt2-medium`,
//! `meta-llama/Llama-2-7b-hf`, `TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T`,
//! `mistralai/Mistral-7B-v0.1`, which uses a sliding window, and the same without it), and the
//! `bad-*` ones edits of them; `transformers5-*` are tiny configs as `transformers` 5.24's
//! `save_pretrained` writes them (`dtype`, `rope_parameters`). The expected counts are the
//! checkpoints' own, as their model cards and `num_parameters()` give them, independent of
//! schedc's formulas.

use schedc::{analyze, MemLoader};
use std::path::Path;

fn config(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hf")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The model the language resolves the imported block into.
fn resolved(block: &str) -> sched_ir::job::Model {
    let loader = MemLoader::default().with("/hf/m.sched", block);
    let a = analyze(Path::new("/hf/m.sched"), &loader).unwrap();
    assert!(!a.has_errors(), "{}\n{block}", a.render());
    (*a.models[0]).clone()
}

/// The parameter count the language gives the imported block.
fn parameters(block: &str) -> u64 {
    resolved(block).parameters()
}

#[test]
fn imported_models_have_the_checkpoints_parameter_counts() {
    for (file, want) in [
        ("gpt2.json", 124_439_808u64),
        ("gpt2-medium.json", 354_823_168),
        ("llama-2-7b.json", 6_738_415_616),
        ("tinyllama-1.1b.json", 1_100_048_384),
        ("mistral-7b-no-window.json", 7_241_732_096),
    ] {
        let name = file.trim_end_matches(".json").replace(['-', '.'], "_");
        let block = schedc::hf::model_from_config(&config(file), &name)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(parameters(&block), want, "{file}:\n{block}");
        insta::assert_snapshot!(name, block);
    }
}

#[test]
fn norm_epsilon_and_rotary_base_are_imported() {
    // The files' own values; `transformers`' defaults (1e-6 for LLaMA's RMSNorm, 1e-5 for GPT-2's
    // LayerNorm, 10,000 for the rotary base) where a config leaves them out.
    let without = |file: &str, keys: &[&str]| {
        let mut c: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&config(file)).unwrap();
        for k in keys {
            c.remove(*k);
        }
        serde_json::to_string(&c).unwrap()
    };
    for (text, eps, base) in [
        (config("llama-rope-500k.json"), 1e-6, Some(500_000.0)),
        (config("tinyllama-1.1b.json"), 1e-5, Some(10_000.0)),
        (config("gpt2.json"), 1e-5, None),
        (
            without("llama-rope-500k.json", &["rms_norm_eps", "rope_theta"]),
            1e-6,
            Some(10_000.0),
        ),
        (without("gpt2.json", &["layer_norm_epsilon"]), 1e-5, None),
        // `transformers` 5 writes `dtype` and `rope_parameters` (`rope_theta` inside).
        (config("transformers5-llama.json"), 1e-6, Some(50_000.0)),
        (config("transformers5-gpt2.json"), 1e-5, None),
    ] {
        let block = schedc::hf::model_from_config(&text, "m").unwrap();
        let m = resolved(&block);
        assert_eq!(m.norm_eps, Some(eps), "{block}");
        assert_eq!(m.rope_base, base, "{block}");
    }
}

#[test]
fn configs_the_language_cannot_express_are_refused_by_field() {
    for (file, field) in [
        ("bad-mistral-sliding-window.json", "sliding_window"),
        ("bad-rope-theta.json", "rope_theta"),
        ("bad-norm-eps.json", "rms_norm_eps"),
        ("bad-rope-scaling.json", "rope_scaling"),
        ("bad-rope-parameters.json", "rope_parameters"),
        ("bad-family.json", "model_type"),
        ("bad-qwen2.json", "model_type"),
        ("bad-unknown-field.json", "qk_layernorm"),
        ("bad-gelu-erf.json", "activation_function"),
        ("bad-missing-hidden.json", "hidden_size"),
        ("bad-truncated.json", ""),
    ] {
        let err = schedc::hf::model_from_config(&config(file), "m")
            .expect_err(&format!("{file} was imported"));
        assert_eq!(err.field, field, "{file}: {err}");
        assert!(!err.message.is_empty(), "{file}");
    }
}
