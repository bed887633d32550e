//! Hugging Face checkpoints (issue 28, item 2): `--init` reads GPT-2 and LLaMA checkpoints in
//! their own names and layouts, one file or sharded, fp32, bf16 or fp16; `--save-hf` writes them
//! back; bad files are refused naming the file.
//!
//! There is no `transformers` here: the checkpoints are built in this file, by hand, from the
//! project's own weights file (its `LAYER.TENSOR` names), following `transformers`' naming and
//! layouts (GPT-2's `Conv1D`s [in, out], LLaMA's separate q, k, v), independently of
//! `schedrun::hf`'s mapping. The parity with `transformers` itself is `hf/parity.py` (not run by
//! the tests).

#[path = "common/cli.rs"]
mod cli;
mod common;

use cli::schedrun;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use sched_ir::job::Model;
use schedrun::checkpoint::{self, Contents};
use schedrun::hf::{self, HfError};
use schedrun::train::{LayerState, State};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Output;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("schedrun-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

/// Seeded weights for every tensor of `model` (values of all magnitudes a bf16 rounds).
fn weights(model: &Model, seed: u64) -> State {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let layers = model
        .layers
        .iter()
        .map(|l| LayerState {
            params: (0..l.params)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * 0.3
                })
                .collect(),
            ..LayerState::default()
        })
        .collect();
    State { layers, step: 0 }
}

/// The project's own tensors of a weights file: name → (shape, values).
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn own_tensors(model: &Model, state: &State) -> Tensors {
    let path = temp(&format!("{}.own.safetensors", model.name));
    checkpoint::save(&path, model, state, Contents::Weights).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (v.shape().to_vec(), values))
        })
        .collect()
}

fn transposed(shape: &[usize], v: &[f32]) -> (Vec<usize>, Vec<f32>) {
    let (r, c) = (shape[0], shape[1]);
    let mut out = vec![0f32; v.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    (vec![c, r], out)
}

/// `own` renamed and laid out as `transformers`' GPT-2 saves it, under `prefix`.
fn gpt2_layout(own: &Tensors, prefix: &str, tied: bool) -> Tensors {
    let mut out = Tensors::new();
    for (name, (shape, v)) in own {
        let (layer, tensor) = name.split_once('.').unwrap();
        let hf = match (layer, tensor) {
            ("embed", t) => format!("{prefix}{t}.weight"),
            ("head", "weight") => "lm_head.weight".to_string(),
            ("head", t) => format!("{prefix}ln_f.{}", t.trim_start_matches("norm.")),
            (b, t) => {
                let n: usize = b
                    .trim_start_matches("block[")
                    .trim_end_matches(']')
                    .parse()
                    .unwrap();
                let t = t
                    .replace("ln1", "ln_1")
                    .replace("ln2", "ln_2")
                    .replace("attn.qkv", "attn.c_attn")
                    .replace("attn.proj", "attn.c_proj")
                    .replace("mlp.fc", "mlp.c_fc")
                    .replace("mlp.proj", "mlp.c_proj");
                format!("{prefix}h.{n}.{t}")
            }
        };
        // Conv1D: products' weights are [in, out].
        let conv =
            hf.ends_with(".weight") && ["c_attn", "c_proj", "c_fc"].iter().any(|c| hf.contains(c));
        let entry = if conv {
            transposed(shape, v)
        } else {
            (shape.clone(), v.clone())
        };
        out.insert(hf, entry);
    }
    assert_eq!(tied, !out.contains_key("lm_head.weight"));
    // `transformers`' GPT-2 checkpoints carry the causal mask as a buffer.
    out.insert(
        format!("{prefix}h.0.attn.bias"),
        (vec![1, 1, 2, 2], vec![1.0, 0.0, 1.0, 1.0]),
    );
    out
}

/// `own` renamed and laid out as `transformers`' LLaMA saves it (`heads` and `kv_dim` split
/// the fused q, k, v rows).
fn llama_layout(own: &Tensors, hidden: usize, kv_dim: usize) -> Tensors {
    let mut out = Tensors::new();
    for (name, (shape, v)) in own {
        let (layer, tensor) = name.split_once('.').unwrap();
        let at = |b: &str| {
            b.trim_start_matches("block[")
                .trim_end_matches(']')
                .parse::<usize>()
                .unwrap()
        };
        match (layer, tensor) {
            ("embed", "wte") => {
                out.insert(
                    "model.embed_tokens.weight".into(),
                    (shape.clone(), v.clone()),
                );
            }
            ("head", "weight") => {
                out.insert("lm_head.weight".into(), (shape.clone(), v.clone()));
            }
            ("head", "norm.weight") => {
                out.insert("model.norm.weight".into(), (shape.clone(), v.clone()));
            }
            (b, "attn.qkv.weight") => {
                let n = at(b);
                let w = shape[1];
                let mut row = 0;
                for (p, rows) in [("q", hidden), ("k", kv_dim), ("v", kv_dim)] {
                    out.insert(
                        format!("model.layers.{n}.self_attn.{p}_proj.weight"),
                        (vec![rows, w], v[row * w..(row + rows) * w].to_vec()),
                    );
                    row += rows;
                }
                assert_eq!(row, shape[0]);
            }
            (b, t) => {
                let hf = match t {
                    "ln1.weight" => "input_layernorm.weight",
                    "ln2.weight" => "post_attention_layernorm.weight",
                    "attn.proj.weight" => "self_attn.o_proj.weight",
                    "mlp.gate.weight" => "mlp.gate_proj.weight",
                    "mlp.up.weight" => "mlp.up_proj.weight",
                    "mlp.proj.weight" => "mlp.down_proj.weight",
                    other => panic!("no LLaMA name for {other}"),
                };
                out.insert(
                    format!("model.layers.{}.{hf}", at(b)),
                    (shape.clone(), v.clone()),
                );
            }
        }
    }
    out
}

fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `tensors` as safetensors bytes in `dtype` (F32 or BF16).
fn serialise(tensors: &Tensors, dtype: StDtype) -> Vec<u8> {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| {
            let bytes = match dtype {
                StDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                StDtype::BF16 => v.iter().flat_map(|&x| bf16(x).to_le_bytes()).collect(),
                _ => unreachable!(),
            };
            (n.clone(), s.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(dtype, s.clone(), d).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, &Some(meta)).unwrap()
}

/// Writes `tensors` into folder `dir` as `shards` files and, for more than one, an index.
fn write_checkpoint(dir: &Path, tensors: &Tensors, dtype: StDtype, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    if shards == 1 {
        std::fs::write(dir.join("model.safetensors"), serialise(tensors, dtype)).unwrap();
        return;
    }
    let names: Vec<&String> = tensors.keys().collect();
    let per = names.len().div_ceil(shards);
    let mut map = serde_json::Map::new();
    for (i, chunk) in names.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let part: Tensors = chunk
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        std::fs::write(dir.join(&file), serialise(&part, dtype)).unwrap();
        for n in chunk {
            map.insert((*n).clone(), Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}

fn gpt() -> Model {
    common::tiny("tiny_gpt")
}

fn llama() -> Model {
    common::tiny("tiny_llama")
}

fn hf_of(model: &Model, own: &Tensors, prefix: &str) -> Tensors {
    if model.name == "tiny_gpt" {
        gpt2_layout(own, prefix, true)
    } else {
        llama_layout(own, 64, 32)
    }
}

#[test]
fn hand_built_checkpoints_load_as_the_projects_weights() {
    for model in [gpt(), llama()] {
        let state = weights(&model, 7);
        let own = own_tensors(&model, &state);
        let rounded = State {
            layers: state
                .layers
                .iter()
                .map(|l| LayerState {
                    params: l
                        .params
                        .iter()
                        .map(|&x| f32::from_bits(u32::from(bf16(x)) << 16))
                        .collect(),
                    ..LayerState::default()
                })
                .collect(),
            step: 0,
        };
        let prefixes: &[&str] = if model.name == "tiny_gpt" {
            &["transformer.", ""]
        } else {
            &[""]
        };
        for prefix in prefixes {
            let tensors = hf_of(&model, &own, prefix);
            for (dtype, want) in [(StDtype::F32, &state), (StDtype::BF16, &rounded)] {
                for shards in [1, 3] {
                    let dir = temp(&format!("{}-{prefix}{dtype:?}-{shards}", model.name));
                    write_checkpoint(&dir, &tensors, dtype, shards);
                    let what = format!("{} {prefix:?} {dtype:?} {shards} shard(s)", model.name);
                    let loaded = hf::load(&dir, &model).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(&loaded, want, "{what}");
                    // The file itself, or the index, name the checkpoint too.
                    let file = if shards == 1 {
                        dir.join(hf::SINGLE)
                    } else {
                        dir.join(hf::INDEX)
                    };
                    assert!(hf::is_hf_checkpoint(&file), "{what}");
                    assert_eq!(&hf::load(&file, &model).unwrap(), want, "{what}");
                }
            }
        }
    }
}

#[test]
fn own_to_hf_to_own_is_bit_identical_in_transformers_names() {
    for model in [gpt(), llama()] {
        let state = weights(&model, 11);
        // Each model's file in its own folder: the config.json written beside it names the family.
        let path = temp(&format!("{}.hf", model.name)).join("weights.safetensors");
        let (written_at, config) = hf::save(&path, &model, &state).unwrap();
        assert_eq!(written_at, path);
        assert_eq!(config, path.with_file_name("config.json"));
        assert!(hf::is_hf_checkpoint(&path));
        assert_eq!(hf::load(&path, &model).unwrap(), state, "{}", model.name);
        // What --save-hf writes is what transformers saves: GPT-2 under `transformer.`.
        let bytes = std::fs::read(&path).unwrap();
        let written: Vec<String> = SafeTensors::deserialize(&bytes)
            .unwrap()
            .names()
            .into_iter()
            .cloned()
            .collect();
        let mut want: Vec<String> = hf_of(&model, &own_tensors(&model, &state), "transformer.")
            .into_keys()
            .filter(|n| !n.ends_with(".attn.bias"))
            .collect();
        let mut written = written;
        written.sort();
        want.sort();
        assert_eq!(written, want, "{}", model.name);
        // The project's own files are not taken for Hugging Face ones.
        let own = temp(&format!("{}.own2.safetensors", model.name));
        checkpoint::save(&own, &model, &state, Contents::Weights).unwrap();
        assert!(!hf::is_hf_checkpoint(&own));
    }
}

#[test]
fn imported_configs_count_the_checkpoints_tensors() {
    let configs = [
        (
            gpt(),
            serde_json::json!({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                "n_inner": 256, "n_positions": 64, "vocab_size": 256, "layer_norm_epsilon": 1e-5}),
        ),
        (
            llama(),
            serde_json::json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "vocab_size": 256, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": false}),
        ),
    ];
    for (model, config) in configs {
        let block = schedc::hf::model_from_config(&config.to_string(), "imported").unwrap();
        let imported = common::model(&block, "imported");
        let path = temp(&format!("{}.count", model.name));
        let (path, _) = hf::save(&path, &model, &weights(&model, 3)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let total: u64 = st
            .tensors()
            .iter()
            .map(|(_, v)| v.shape().iter().product::<usize>() as u64)
            .sum();
        assert_eq!(imported.parameters(), total, "{}", model.name);
        // And the imported model loads the checkpoint.
        hf::load(&path, &imported).unwrap();
    }
}

/// The error `hf::load` gives for the checkpoint folder `dir`, with its message.
fn refused(dir: &Path, model: &Model) -> (HfError, String) {
    let e = hf::load(dir, model).expect_err("loaded");
    let m = e.to_string();
    (e, m)
}

#[test]
fn bad_checkpoints_are_refused_naming_the_file_and_the_problem() {
    let model = llama();
    let own = own_tensors(&model, &weights(&model, 5));
    let good = hf_of(&model, &own, "");

    // A truncated shard.
    let dir = temp("bad-truncated");
    write_checkpoint(&dir, &good, StDtype::F32, 2);
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Format { .. }), "{m}");
    assert!(
        m.contains("model-00002-of-00002.safetensors") && m.contains("truncated"),
        "{m}"
    );

    // A damaged header: its length field says more bytes than the file has, or its JSON is not
    // a safetensors header.
    for (name, damage) in [("bad-header-length", 0usize), ("bad-header-json", 1)] {
        let dir = temp(name);
        write_checkpoint(&dir, &good, StDtype::F32, 1);
        let file = dir.join(hf::SINGLE);
        let mut bytes = std::fs::read(&file).unwrap();
        if damage == 0 {
            bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        } else {
            bytes[8] = b'[';
        }
        std::fs::write(&file, &bytes).unwrap();
        let (e, m) = refused(&dir, &model);
        assert!(matches!(e, HfError::Format { .. }), "{m}");
        assert!(
            m.contains(hf::SINGLE) && m.contains("not a safetensors file"),
            "{m}"
        );
    }

    // An index naming a missing shard.
    let dir = temp("bad-missing-shard");
    write_checkpoint(&dir, &good, StDtype::F32, 2);
    std::fs::remove_file(dir.join("model-00001-of-00002.safetensors")).unwrap();
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::MissingShard { .. }), "{m}");
    assert!(
        m.contains(hf::INDEX) && m.contains("model-00001-of-00002.safetensors"),
        "{m}"
    );

    // A missing tensor.
    let dir = temp("bad-missing-tensor");
    let mut t = good.clone();
    t.remove("model.layers.1.mlp.up_proj.weight");
    write_checkpoint(&dir, &t, StDtype::F32, 1);
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Missing { .. }), "{m}");
    assert!(
        m.contains(hf::SINGLE) && m.contains("model.layers.1.mlp.up_proj.weight"),
        "{m}"
    );

    // A tensor of the wrong shape (a k projection for 4 kv heads, not 2).
    let dir = temp("bad-shape");
    let mut t = good.clone();
    t.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        (vec![64, 64], vec![0.0; 64 * 64]),
    );
    write_checkpoint(&dir, &t, StDtype::F32, 1);
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Shape { .. }), "{m}");
    assert!(
        m.contains(hf::SINGLE) && m.contains("k_proj") && m.contains("[32, 64]"),
        "{m}"
    );

    // A tensor of the wrong dtype.
    let dir = temp("bad-dtype");
    std::fs::create_dir_all(&dir).unwrap();
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = good
        .iter()
        .map(|(n, (s, v))| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let norm = data
        .iter_mut()
        .find(|d| d.0 == "model.norm.weight")
        .unwrap();
    norm.2 = vec![0u8; 64 * 8];
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, d)| {
            let dtype = if n == "model.norm.weight" {
                StDtype::F64
            } else {
                StDtype::F32
            };
            (n.clone(), TensorView::new(dtype, s.clone(), d).unwrap())
        })
        .collect();
    std::fs::write(
        dir.join(hf::SINGLE),
        safetensors::serialize(views, &None).unwrap(),
    )
    .unwrap();
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Dtype { .. }), "{m}");
    assert!(
        m.contains(hf::SINGLE) && m.contains("model.norm.weight") && m.contains("F64"),
        "{m}"
    );

    // An unknown architecture in config.json.
    let dir = temp("bad-architecture");
    write_checkpoint(&dir, &good, StDtype::F32, 1);
    std::fs::write(dir.join(hf::CONFIG), r#"{"model_type": "falcon"}"#).unwrap();
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Architecture { .. }), "{m}");
    assert!(m.contains(hf::CONFIG) && m.contains("falcon"), "{m}");

    // A config of the other family, and a checkpoint of the other family.
    std::fs::write(dir.join(hf::CONFIG), r#"{"model_type": "gpt2"}"#).unwrap();
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Family { .. }), "{m}");
    std::fs::write(dir.join(hf::CONFIG), r#"{"model_type": "llama"}"#).unwrap();
    hf::load(&dir, &model).unwrap();
    let (e, m) = refused(&dir, &gpt());
    assert!(
        matches!(e, HfError::Family { .. }) && m.contains("LLaMA"),
        "{m}"
    );

    // Tensors the model does not have (a third layer).
    let dir = temp("bad-extra");
    let mut t = good.clone();
    t.insert(
        "model.layers.2.input_layernorm.weight".into(),
        (vec![64], vec![1.0; 64]),
    );
    write_checkpoint(&dir, &t, StDtype::F32, 1);
    let (e, m) = refused(&dir, &model);
    assert!(matches!(e, HfError::Extra { .. }), "{m}");
    assert!(m.contains("model.layers.2.input_layernorm.weight"), "{m}");
}

fn losses(out: &Output) -> Vec<f64> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["loss"].as_f64())
        .collect()
}

#[test]
fn init_from_a_hf_checkpoint_trains_like_init_from_the_same_weights() {
    let sched = "runtime/tests/inputs/hf.sched";
    for (schedule, model) in [("gpt_zero3", gpt()), ("llama_zero2", llama())] {
        let state = weights(&model, 21);
        let own = temp(&format!("{schedule}.own.safetensors"));
        checkpoint::save(&own, &model, &state, Contents::Weights).unwrap();
        let dir = temp(&format!("{schedule}-hf"));
        write_checkpoint(
            &dir,
            &hf_of(&model, &own_tensors(&model, &state), "transformer."),
            StDtype::F32,
            2,
        );
        let config = if model.name == "tiny_gpt" {
            "gpt2"
        } else {
            "llama"
        };
        std::fs::write(
            dir.join(hf::CONFIG),
            format!(r#"{{"model_type": "{config}"}}"#),
        )
        .unwrap();
        let run = |init: &Path, extra: &[&str]| {
            let mut args = vec![sched, "--schedule", schedule, "--steps", "2", "--json"];
            args.extend(["--init", init.to_str().unwrap()]);
            args.extend(extra);
            schedrun(&args)
        };
        let ck = temp(&format!("{schedule}.ck.safetensors"));
        // A folder: model.safetensors and config.json, as save_pretrained writes them.
        let saved = temp(&format!("{schedule}.saved-hf"));
        let from_own = losses(&run(&own, &[]));
        let from_hf = losses(&run(
            &dir,
            &[
                "--save",
                ck.to_str().unwrap(),
                "--save-hf",
                saved.to_str().unwrap(),
            ],
        ));
        assert_eq!(from_own.len(), 2);
        assert_eq!(
            from_own, from_hf,
            "{schedule}: losses from the own and HF layouts"
        );
        // --save-hf holds the weights --save does.
        let own_after = checkpoint::load(&ck, &model, Contents::Checkpoint).unwrap();
        assert!(saved.join(hf::SINGLE).is_file() && saved.join(hf::CONFIG).is_file());
        let hf_after = hf::load(&saved, &model).unwrap();
        let params = |s: State| s.into_params();
        assert_eq!(params(own_after), params(hf_after), "{schedule}");
    }
}

/// Each of the issue's bad inputs stops `schedrun --init` with exit 1 and one line naming the
/// file and the problem, before any step, with none of `--save`, `--save-hf` (its weights and
/// config) or `--save-init` written.
#[test]
fn every_bad_checkpoint_stops_schedrun_naming_the_file_and_nothing_is_written() {
    let model = llama();
    let good = hf_of(&model, &own_tensors(&model, &weights(&model, 5)), "");
    let mut cases: Vec<(&str, PathBuf, &str)> = vec![];
    // A truncated shard of two.
    let dir = temp("cli-truncated");
    write_checkpoint(&dir, &good, StDtype::F32, 2);
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    cases.push(("truncated", dir, "model-00002-of-00002.safetensors"));
    // A header that is not one.
    let dir = temp("cli-header");
    write_checkpoint(&dir, &good, StDtype::F32, 1);
    let file = dir.join(hf::SINGLE);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    cases.push(("header", dir, hf::SINGLE));
    // A missing tensor.
    let dir = temp("cli-missing");
    let mut t = good.clone();
    t.remove("model.layers.0.self_attn.v_proj.weight");
    write_checkpoint(&dir, &t, StDtype::F32, 1);
    cases.push(("missing", dir, "v_proj"));
    // A tensor of the wrong shape.
    let dir = temp("cli-shape");
    let mut t = good.clone();
    t.insert("model.norm.weight".into(), (vec![65], vec![1.0; 65]));
    write_checkpoint(&dir, &t, StDtype::F32, 1);
    cases.push(("shape", dir, "model.norm.weight"));
    // A tensor of the wrong dtype (all of them: F64).
    let dir = temp("cli-dtype");
    std::fs::create_dir_all(&dir).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = good
        .iter()
        .map(|(n, (s, v))| {
            let b = v.iter().flat_map(|&x| f64::from(x).to_le_bytes()).collect();
            (n.clone(), s.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(StDtype::F64, s.clone(), d).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join(hf::SINGLE),
        safetensors::serialize(views, &None).unwrap(),
    )
    .unwrap();
    cases.push(("dtype", dir, "F64"));
    // An unknown architecture in config.json.
    let dir = temp("cli-architecture");
    write_checkpoint(&dir, &good, StDtype::F32, 1);
    std::fs::write(dir.join(hf::CONFIG), r#"{"model_type": "mamba"}"#).unwrap();
    cases.push(("architecture", dir, "mamba"));
    for (what, dir, names) in cases {
        let outs = temp(&format!("cli-bad-{what}-out"));
        std::fs::create_dir_all(&outs).unwrap();
        let (save, save_hf, init) = (
            outs.join("ck.safetensors"),
            outs.join("hf"),
            outs.join("init.safetensors"),
        );
        let out = schedrun(&[
            "runtime/tests/inputs/hf.sched",
            "--schedule",
            "llama_zero2",
            "--init",
            dir.to_str().unwrap(),
            "--save",
            save.to_str().unwrap(),
            "--save-hf",
            save_hf.to_str().unwrap(),
            "--save-init",
            init.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert_eq!(err.lines().count(), 1, "{what}: {err}");
        let named = err.contains(dir.to_str().unwrap());
        assert!(named && err.contains(names), "{what}: {err}");
        let left: Vec<_> = std::fs::read_dir(&outs).unwrap().collect();
        assert!(left.is_empty(), "{what}: {left:?} written");
    }
}

#[test]
fn a_bad_checkpoint_stops_schedrun_before_anything_is_written() {
    let dir = temp("cli-bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(hf::INDEX),
        r#"{"weight_map": {"model.embed_tokens.weight": "gone.safetensors"}}"#,
    )
    .unwrap();
    let out_file = temp("cli-bad.out.safetensors");
    let hf_file = temp("cli-bad.out-hf");
    let out = schedrun(&[
        "runtime/tests/inputs/hf.sched",
        "--schedule",
        "llama_zero2",
        "--init",
        dir.to_str().unwrap(),
        "--save",
        out_file.to_str().unwrap(),
        "--save-hf",
        hf_file.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("gone.safetensors") && err.contains(hf::INDEX),
        "{err}"
    );
    assert!(!out_file.exists() && !hf_file.exists());
}

/// The parity with `transformers` itself (`hf/parity.py`, whose docstring lists what it checks:
/// parameter counts, first-step losses within 1e-5 relative from fp32, sharded and bf16
/// checkpoints, and `--save-hf` weights and config loaded back by `from_pretrained`), for tiny
/// GPT-2s and LLaMAs (tied and untied, grouped- and multi-query attention). It runs where `python3` imports `torch`
/// and `transformers`; elsewhere it says SKIPPED (`torch`; CI does not install PyTorch).
#[test]
fn hf_parity_with_transformers() {
    use std::process::Command;
    let probe = Command::new("python3")
        .args(["-c", "import torch, transformers"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr);
            let why = why.lines().last().unwrap_or("").to_string();
            return schedc::testing::skip(
                "torch",
                &format!("python3 cannot import torch and transformers ({why})"),
            );
        }
        Err(e) => return schedc::testing::skip("torch", &format!("no python3: {e}")),
    }
    let bin = cli::schedc_binary();
    let out = Command::new("python3")
        .arg("runtime/tests/hf/parity.py")
        .arg("--bin")
        .arg(bin.parent().unwrap())
        .current_dir(cli::root())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // The numbers, shown with --nocapture.
    println!("{text}");
    assert!(
        out.status.success() && text.trim_end().ends_with("ok"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--save-hf`'s config.json is the family's own: `schedc import hf` on it gives back the model
/// (its layers, sequence length, norms' epsilon, rotary base and dtype), and a bf16 model's
/// weights are written as BF16, loading back to the bf16-rounded state. (That `transformers`
/// reads the config: `hf_parity_with_transformers`.)
#[test]
fn save_hf_writes_the_familys_config_and_bf16_for_a_bf16_model() {
    for model in [gpt(), llama()] {
        for dtype in [sched_ir::job::Dtype::Fp32, sched_ir::job::Dtype::Bf16] {
            let mut model = model.clone();
            model.dtype = dtype;
            let dir = temp(&format!("{}-{dtype:?}-config", model.name));
            let state = weights(&model, 9);
            let (file, config) = hf::save(&dir, &model, &state).unwrap();
            assert_eq!(
                (file.clone(), config.clone()),
                (dir.join(hf::SINGLE), dir.join(hf::CONFIG))
            );
            let text = std::fs::read_to_string(&config).unwrap();
            let block = schedc::hf::model_from_config(&text, "back")
                .unwrap_or_else(|e| panic!("{text}: {e}"));
            let back = common::model(&block, "back");
            assert_eq!(back.layers, model.layers, "{block}");
            assert_eq!(
                (back.seq_len, back.dtype, back.norm_eps(), back.rope_base()),
                (model.seq_len, dtype, model.norm_eps(), model.rope_base()),
                "{block}"
            );
            let bytes = std::fs::read(&file).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let want = match dtype {
                sched_ir::job::Dtype::Bf16 => StDtype::BF16,
                _ => StDtype::F32,
            };
            assert!(st.tensors().iter().all(|(_, v)| v.dtype() == want));
            let loaded = hf::load(&dir, &model).unwrap();
            let rounded: Vec<f32> = state
                .clone()
                .into_params()
                .into_iter()
                .map(|x| match dtype {
                    sched_ir::job::Dtype::Bf16 => schedrun::math::round_bf16(x),
                    _ => x,
                })
                .collect();
            assert_eq!(loaded.into_params(), rounded, "{} {dtype:?}", model.name);
        }
    }
}
