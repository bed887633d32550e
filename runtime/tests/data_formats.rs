//! Tokenized data (`runtime.md`, "Data and batches"): llm.c's and nanoGPT's `.bin`, NumPy's `.npy`
//! and text through a `tokenizer.json` read back as the tokens written; each damaged file refused
//! by name and problem with nothing written; the vocabulary check; windows by the batch rule; the
//! validation loss against the training loss of the same batches; the loss plot. Every file is
//! made here, in a temporary folder: nothing is downloaded.

use schedrun::data::{
    BatchShape, Corpus, DataError, Format, FormatProblem, TextTokenizer, Tokens, Windows,
};
use schedrun::plot::LossCurve;
use std::path::{Path, PathBuf};

#[path = "common/cli.rs"]
mod cli;

use cli::{json_lines, s, schedrun, stderr};

/// A fresh folder for one test.
fn temp(test: &str) -> PathBuf {
    cli::fresh_dir("data", test)
}

// ---- writers, as llm.c, nanoGPT and numpy write ----

fn llmc_bytes(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    let mut b: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    b
}

fn llmc(tokens: &[u16]) -> Vec<u8> {
    llmc_bytes(20240520, 1, tokens.len() as i32, tokens)
}

fn nanogpt(tokens: &[u16]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// A `.npy` file of version 1.0 as `numpy.save` writes it: the header padded with spaces to a
/// multiple of 64 bytes, ending in a newline.
fn npy(descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
        if fortran { "True" } else { "False" }
    );
    let mut header = dict.into_bytes();
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((header.len() as u16).to_le_bytes());
    b.extend(header);
    b.extend(data);
    b
}

fn npy_u16(tokens: &[u16]) -> Vec<u8> {
    let data: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    npy("<u2", false, &format!("({},)", tokens.len()), &data)
}

fn npy_i32(tokens: &[i32]) -> Vec<u8> {
    let data: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    npy("<i4", false, &format!("({},)", tokens.len()), &data)
}

fn npy_i64(tokens: &[i64]) -> Vec<u8> {
    let data: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    npy("<i8", false, &format!("({},)", tokens.len()), &data)
}

/// A learnable token stream below `vocab`: mostly t → (5t + 3) mod vocab, with a little noise.
fn stream(n: usize, vocab: u32) -> Vec<u16> {
    let mut t = 1u32;
    let mut x = 12345u64;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            t = if (x >> 60) == 0 {
                ((x >> 33) % u64::from(vocab)) as u32
            } else {
                (5 * t + 3) % vocab
            };
            t as u16
        })
        .collect()
}

fn as_u32(t: &Tokens) -> Vec<u32> {
    (0..t.len()).map(|i| t.get(i)).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

// ---- reading ----

#[test]
fn each_format_reads_back_the_tokens_written() {
    let dir = temp("formats");
    let tokens = stream(1000, 50257);
    let want: Vec<u32> = tokens.iter().map(|&t| u32::from(t)).collect();
    let i32s: Vec<i32> = tokens.iter().map(|&t| i32::from(t)).collect();
    let i64s: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let cases = [
        ("shard.bin", llmc(&tokens), Format::Llmc { width: 2 }),
        ("raw.bin", nanogpt(&tokens), Format::NanoGpt),
        (
            "u16.npy",
            npy_u16(&tokens),
            Format::Npy {
                header: 128,
                width: 2,
            },
        ),
        (
            "i32.npy",
            npy_i32(&i32s),
            Format::Npy {
                header: 128,
                width: 4,
            },
        ),
        (
            "i64.NPY",
            npy_i64(&i64s),
            Format::Npy {
                header: 128,
                width: 8,
            },
        ),
    ];
    for (name, bytes, format) in cases {
        let p = write(&dir, name, &bytes);
        let c = Corpus::open(&p, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.format(), format, "{name}");
        assert_eq!(as_u32(c.tokens()), want, "{name}");
        assert_eq!(c.path(), Some(p.as_path()));
        assert!(c.bytes().is_empty(), "{name}: a token corpus has no bytes");
    }
    // llm.c's LLaMA-3 shard: magic 20240801, version 7, uint32 tokens.
    let big: Vec<u32> = (0..300).map(|i| 100_000 + i * 7).collect();
    let mut b = llmc_bytes(20240801, 7, big.len() as i32, &[]);
    b.extend(big.iter().flat_map(|t| t.to_le_bytes()));
    let c = Corpus::open(&write(&dir, "llama3.bin", &b), None).unwrap();
    assert_eq!(c.format(), Format::Llmc { width: 4 });
    assert_eq!(as_u32(c.tokens()), big);
    // Any other name is text read as bytes, as before.
    let c = Corpus::open(&write(&dir, "notes.txt", b"hello tokens"), None).unwrap();
    assert_eq!(c.format(), Format::Bytes);
    assert_eq!(c.bytes(), b"hello tokens");
    assert_eq!(c, Corpus::load(Some(&dir.join("notes.txt"))).unwrap());
}

#[test]
fn windows_follow_the_batch_rule_on_tokens_and_repeat_run_to_run() {
    let dir = temp("windows");
    let tokens: Vec<u16> = (0..100).map(|i| 1000 + i).collect();
    let p = write(&dir, "t.bin", &llmc(&tokens));
    let c = Corpus::open(&p, None).unwrap();
    // The byte rule's test, in tokens: (g·8) mod (100 − 8 − 1 = 91).
    let (x, y) = c.sequence(12, 8).unwrap();
    assert_eq!(x, (1005..1013).collect::<Vec<u32>>());
    assert_eq!(y, (1006..1014).collect::<Vec<u32>>());
    assert_eq!(c.offset(91, 8).unwrap(), 0);
    // The same file read again, and as nanoGPT's or numpy's, gives the same batches.
    let again = Corpus::open(&write(&dir, "t.npy", &npy_u16(&tokens)), None).unwrap();
    let raw = Corpus::open(&write(&dir, "r.bin", &nanogpt(&tokens)), None).unwrap();
    for step in 0..5 {
        let b = c.global_batch(step, 12, 8).unwrap();
        assert_eq!(b, again.global_batch(step, 12, 8).unwrap());
        assert_eq!(b, raw.global_batch(step, 12, 8).unwrap());
        assert_eq!(
            b,
            Corpus::open(&p, None)
                .unwrap()
                .global_batch(step, 12, 8)
                .unwrap()
        );
    }
    // Too few tokens: named in tokens, with the file.
    let short = Corpus::open(&write(&dir, "s.bin", &llmc(&tokens[..9])), None).unwrap();
    let e = short.sequence(0, 8).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: 9 tokens, too few for seq_len 8: it needs at least 10 (seq_len + 2)",
            dir.join("s.bin").display()
        )
    );
}

// ---- refusals ----

/// Damaged files: (name, bytes, what the message must say).
fn damaged() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let t = stream(600, 256);
    let mut truncated = llmc(&t);
    truncated.truncate(truncated.len() - 100);
    let mut trailing = llmc(&t);
    trailing.extend([0, 0]);
    let data: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
    let floats: Vec<u8> = t.iter().flat_map(|&x| f32::from(x).to_le_bytes()).collect();
    let mut npy_cut = npy_u16(&t);
    npy_cut.truncate(npy_cut.len() - 3);
    let mut negative: Vec<i32> = t.iter().map(|&x| i32::from(x)).collect();
    negative[17] = -5;
    vec![
        ("truncated.bin", truncated, "a truncated shard?"),
        ("trailing.bin", trailing, "trailing bytes"),
        (
            "short_header.bin",
            llmc(&t)[..600].to_vec(),
            "1024-byte header, but the file has only 600 bytes",
        ),
        (
            "version.bin",
            llmc_bytes(20240520, 3, 600, &t),
            "llm.c shard of version 3",
        ),
        (
            "odd.bin",
            nanogpt(&t)[..1001].to_vec(),
            "1001 bytes are not a whole number of uint16 tokens",
        ),
        ("magic.npy", data.clone(), "not a NumPy .npy file"),
        (
            "float.npy",
            npy("<f4", false, "(600,)", &floats),
            "dtype '<f4' is not a token type",
        ),
        (
            "bigendian.npy",
            npy(">u2", false, "(600,)", &data),
            "dtype '>u2' is not a token type",
        ),
        (
            "matrix.npy",
            npy("<u2", false, "(20, 30)", &data),
            "shape (20, 30) is not one dimension",
        ),
        (
            "fortran.npy",
            npy("<u2", true, "(600,)", &data),
            "Fortran order",
        ),
        (
            "cut.npy",
            npy_cut,
            "needs 1200 bytes of data, but 1197 follow the header (a truncated file?)",
        ),
        (
            "negative.npy",
            npy_i32(&negative),
            "token -5 at token offset 17 is negative",
        ),
        (
            "garbled.npy",
            npy("<u2", false, "600", &data)[..].to_vec(),
            "the .npy header is not a dictionary",
        ),
        (
            "version.npy",
            {
                let mut b = npy_u16(&t);
                b[6] = 9;
                b
            },
            "NumPy format version 9.0",
        ),
    ]
}

/// `--windows seeded` (an opt-in; the default stays the batch rule): the same seed gives the same
/// windows, another seed others; the windows stay inside the file and the rank split of the
/// batch rule holds (a rank's micro-batch is its sequences of the global batch).
#[test]
fn seeded_windows_repeat_for_a_seed_and_differ_for_another() {
    let dir = temp("seeded");
    let tokens: Vec<u16> = (0..5000).map(|i| (i % 4000) as u16).collect();
    let p = write(&dir, "t.bin", &llmc(&tokens));
    let strided = Corpus::open(&p, None).unwrap();
    assert_eq!(strided.windows(), Windows::Strided, "the default");
    let seeded = |seed| {
        Corpus::open(&p, None)
            .unwrap()
            .with_windows(Windows::Seeded(seed))
    };
    let (a, a2, b) = (seeded(7), seeded(7), seeded(8));
    let span = 5000 - 16 - 1;
    let starts = |c: &Corpus| {
        (0..200)
            .map(|g| c.offset(g, 16).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(starts(&a), starts(&a2));
    assert_ne!(starts(&a), starts(&b));
    assert_ne!(starts(&a), starts(&strided));
    assert!(starts(&a).iter().all(|&o| o < span));
    // Spread over the file, not bunched: every tenth of it is hit.
    let mut tenths = [0; 10];
    starts(&a).iter().for_each(|&o| tenths[o * 10 / span] += 1);
    assert!(tenths.iter().all(|&n| n > 0), "{tenths:?}");
    for step in 0..3 {
        let global = a.global_batch(step, 8, 16).unwrap();
        assert_eq!(global, a2.global_batch(step, 8, 16).unwrap());
        assert_ne!(global, b.global_batch(step, 8, 16).unwrap());
        // Sequence k of the global batch is sequence step·B + k, as with the batch rule.
        let shape = BatchShape {
            ranks: 4,
            micro_steps: 2,
            micro_batch: 1,
            seq_len: 16,
        };
        for m in 0..2 {
            for r in 0..4 {
                let (x, y) = a.batch(&shape, (step, m, r)).unwrap();
                let k = m * 4 + r;
                assert_eq!(x, global.inputs[k * 16..(k + 1) * 16]);
                assert_eq!(y, global.targets[k * 16..(k + 1) * 16]);
            }
        }
    }
}

/// Parity twins still match with seeded windows: ZeRO-3 (`tiny_cpu.sched`) and ZeRO-1 on the
/// same 4 ranks (the same global batch) give the same losses, run to run; and the flag changes
/// the losses from the strided default, which `--windows strided` keeps.
#[test]
fn seeded_windows_keep_the_parity_of_zero3_and_zero1() {
    let run = |file: &str, schedule: Option<&str>, extra: &[&str]| -> Vec<f64> {
        let mut args = vec![file, "--steps", "3", "--lr", "1e-3", "--json"];
        if let Some(name) = schedule {
            args.extend(["--schedule", name]);
        }
        args.extend(extra);
        let out = schedrun(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        json_lines(&out)
            .iter()
            .filter_map(|l| l.get("loss").and_then(|v| v.as_f64()))
            .collect()
    };
    let zero3 = |extra: &[&str]| run("schedules/tiny_cpu.sched", None, extra);
    let seeded = ["--windows", "seeded", "--seed", "3"];
    let a = zero3(&seeded);
    let twin = run(
        "schedules/tiny_cpu_schedules.sched",
        Some("tiny_zero1"),
        &seeded,
    );
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&twin) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "zero3 {a:?}, zero1 {twin:?}"
        );
    }
    assert_eq!(a, zero3(&seeded), "run to run");
    let strided = zero3(&["--seed", "3"]);
    assert_eq!(strided, zero3(&["--seed", "3", "--windows", "strided"]));
    assert_ne!(a, strided, "seeded windows are other windows");
}

#[test]
fn a_damaged_file_is_refused_by_name_and_problem() {
    let dir = temp("damaged");
    for (name, bytes, says) in damaged() {
        let p = write(&dir, name, &bytes);
        let e = Corpus::open(&p, None).unwrap_err();
        assert!(matches!(e, DataError::Malformed { .. }), "{name}: {e:?}");
        let m = e.to_string();
        assert!(m.starts_with(&format!("{}: ", p.display())), "{name}: {m}");
        assert!(m.contains(says), "{name}: {m}");
    }
}

#[test]
fn a_damaged_file_stops_schedrun_before_the_first_step_and_nothing_is_written() {
    let dir = temp("damaged-cli");
    let good = write(&dir, "good.bin", &llmc(&stream(2000, 256)));
    let out_dir = dir.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let (save, init, plot) = (
        out_dir.join("ckpt.safetensors"),
        out_dir.join("init.safetensors"),
        out_dir.join("loss.svg"),
    );
    let outputs = [
        "--save",
        s(&save),
        "--save-init",
        s(&init),
        "--plot",
        s(&plot),
    ];
    let mut cases: Vec<(Vec<&str>, PathBuf, String)> = vec![];
    let files: Vec<(PathBuf, &str)> = damaged()
        .into_iter()
        .map(|(name, bytes, says)| (write(&dir, name, &bytes), says))
        .collect();
    for (p, says) in &files {
        // As the training data and as the validation file.
        cases.push((vec!["--data", s(p)], p.clone(), says.to_string()));
        cases.push((
            vec!["--data", s(&good), "--val", s(p)],
            p.clone(),
            says.to_string(),
        ));
    }
    // A token the model (vocab 256) has no row for.
    let mut t = stream(2000, 256);
    t[1234] = 300;
    let oov = write(&dir, "oov.bin", &llmc(&t));
    cases.push((
        vec!["--data", s(&oov)],
        oov.clone(),
        "token 300 at token offset 1234 (byte 3492 of the file) is not below the model's vocabulary of 256".into(),
    ));
    let missing_tok = dir.join("no-tokenizer.json");
    cases.push((
        vec!["--data", s(&good), "--tokenizer", s(&missing_tok)],
        missing_tok.clone(),
        "cannot use the tokenizer".into(),
    ));
    for (args, file, says) in &cases {
        let mut a = vec!["schedules/tiny_cpu.sched", "--steps", "2"];
        a.extend(args);
        a.extend(outputs);
        let out = schedrun(&a);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(s(file)) && err.contains(says.as_str()),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "one clear error: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: a step ran");
        let left: Vec<_> = std::fs::read_dir(&out_dir).unwrap().flatten().collect();
        assert!(left.is_empty(), "{args:?}: wrote {left:?}");
    }
}

#[test]
fn a_token_at_or_above_the_vocabulary_is_named_with_its_offset() {
    let dir = temp("vocab");
    let mut t: Vec<i64> = (0..50).collect();
    t[40] = 256;
    let p = write(&dir, "t.npy", &npy_i64(&t));
    let c = Corpus::open(&p, None).unwrap();
    c.check_vocabulary(257).unwrap();
    let e = c.check_vocabulary(256).unwrap_err();
    assert!(matches!(
        e,
        DataError::OutOfVocabulary {
            token: 256,
            index: 40,
            byte: Some(448),
            vocab: 256,
            ..
        }
    ));
    assert_eq!(
        e.to_string(),
        format!(
            "{}: token 256 at token offset 40 (byte 448 of the file) is not below the model's vocabulary of 256",
            p.display()
        )
    );
    // int64 tokens past 32 bits cannot be ids at all.
    let p = write(&dir, "huge.npy", &npy_i64(&[1, 2, 1 << 40]));
    let e = Corpus::open(&p, None).unwrap_err();
    assert!(matches!(
        e,
        DataError::Malformed {
            problem: FormatProblem::TokenTooLarge { index: 2, .. },
            ..
        }
    ));
}

// ---- tokenizer.json ----

/// A byte-level BPE in GPT-2's layout (its pre-tokenizer's regex and byte alphabet) with a
/// handful of tokens: "Ġ" is the space byte, merges build "ab", "Ġab" and "Ġc".
const BPE: &str = r#"{
  "version": "1.0", "truncation": {"max_length": 2, "strategy": "LongestFirst", "stride": 0, "direction": "Right"},
  "padding": null, "added_tokens": [], "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "Ċ": 4, "ab": 5, "Ġab": 6, "Ġc": 7},
            "merges": ["a b", "Ġ ab", "Ġ c"]}
}"#;

/// A word-level tokenizer splitting on whitespace, with an unknown token.
const WORDS: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
  "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, ".": 4, "on": 5, "mat": 6}, "unk_token": "[UNK]"}
}"#;

#[test]
fn text_through_a_tokenizer_json_gives_its_ids() {
    let dir = temp("tokenizer");
    let words = TextTokenizer::load(&write(&dir, "words.json", WORDS.as_bytes())).unwrap();
    assert_eq!(words.vocab_size(), 7);
    assert_eq!(
        words.encode("The cat sat on the mat.").unwrap(),
        [1, 2, 3, 5, 1, 6, 4]
    );
    assert_eq!(words.encode("the dog").unwrap(), [1, 0]);
    let bpe_file = write(&dir, "tokenizer.json", BPE.as_bytes());
    let bpe = TextTokenizer::load(&bpe_file).unwrap();
    // The file's truncation (max_length 2) is off: every token of the text is kept.
    assert_eq!(bpe.encode("ab ab c\nab").unwrap(), [5, 6, 7, 4, 5]);
    // A text file through the tokenizer: a corpus of those ids.
    let text = write(&dir, "corpus.txt", "ab ab c\nab".repeat(20).as_bytes());
    let c = Corpus::open(&text, Some(&bpe)).unwrap();
    assert_eq!(c.format(), Format::Text);
    assert_eq!(as_u32(c.tokens())[..6], [5, 6, 7, 4, 5, 5]);
    assert_eq!(
        c.len(),
        bpe.encode(&"ab ab c\nab".repeat(20)).unwrap().len()
    );
    // Text that is not UTF-8, and a tokenizer that is not one, by name.
    let bad = write(&dir, "latin1.txt", b"caf\xe9 ab");
    let e = Corpus::open(&bad, Some(&bpe)).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: not UTF-8 text at byte 3: a tokenizer reads text",
            bad.display()
        )
    );
    let junk = write(&dir, "junk.json", b"{\"model\": 3}");
    let e = TextTokenizer::load(&junk).err().unwrap().to_string();
    assert!(
        e.starts_with(&format!("cannot use the tokenizer {}: ", junk.display())),
        "{e}"
    );
}

#[test]
fn schedrun_trains_on_tokenized_text() {
    let dir = temp("tokenizer-cli");
    let tok = write(&dir, "tokenizer.json", BPE.as_bytes());
    let body = "ab ab c\nab c ab\n".repeat(100);
    let text = write(&dir, "corpus.txt", body.as_bytes());
    let n = TextTokenizer::load(&tok)
        .unwrap()
        .encode(&body)
        .unwrap()
        .len();
    assert_eq!(n, 800);
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "2",
        "--json",
        "--tokenizer",
        s(&tok),
        "--data",
        s(&text),
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("(text through a tokenizer): 800 tokens"),
        "{err}"
    );
    assert!(err.contains("sequences of 64 tokens"), "{err}");
    assert_eq!(json_lines(&out).len(), 3);
    // A tokenizer needs a text to encode.
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "1",
        "--tokenizer",
        s(&tok),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("give --data"), "{}", stderr(&out));
}

// ---- validation loss and the plot ----

/// With a learning rate of 0 the weights never change, so the validation loss over K batches of
/// the training file itself is the mean of the first K steps' training losses: the reference
/// model's forward on gathered weights against the sharded ZeRO-3 step's.
#[test]
fn the_validation_loss_equals_the_training_loss_of_the_same_batches() {
    let dir = temp("val-equal");
    let data = write(&dir, "train.bin", &llmc(&stream(5000, 256)));
    // ZeRO-3 (tiny GPT) and a two-stage 1F1B pipeline (tiny LLaMA).
    for sched in ["schedules/tiny_cpu.sched", "schedules/tiny_pipeline.sched"] {
        let out = schedrun(&[
            sched,
            "--steps",
            "3",
            "--lr",
            "0",
            "--json",
            "--data",
            s(&data),
            "--val",
            s(&data),
            "--eval-every",
            "2",
            "--eval-batches",
            "3",
        ]);
        assert!(out.status.success(), "{sched}: {}", stderr(&out));
        let lines = json_lines(&out);
        let losses: Vec<f64> = lines[..3]
            .iter()
            .map(|l| l["loss"].as_f64().unwrap())
            .collect();
        let mean = losses.iter().sum::<f64>() / 3.0;
        // After step 2 (a multiple of --eval-every) and after the last step, not after step 1.
        assert!(lines[0].get("val_loss").is_none());
        for l in [&lines[1], &lines[2]] {
            let v = l["val_loss"].as_f64().unwrap();
            assert!(
                ((v - mean) / mean).abs() < 1e-5,
                "{sched}: val {v} vs mean training loss {mean}"
            );
        }
        assert_eq!(lines[3]["summary"]["val_loss"], lines[2]["val_loss"]);
    }
    // --eval-batches 1: the first step's loss alone.
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "1",
        "--lr",
        "0",
        "--data",
        s(&data),
        "--val",
        s(&data),
        "--eval-batches",
        "1",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text.lines().next().unwrap();
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        (cols[2], cols[cols.len() - 3]),
        ("loss", "val"),
        "human line: {line}"
    );
    let (loss, val): (f64, f64) = (
        cols[3].parse().unwrap(),
        cols[cols.len() - 1].parse().unwrap(),
    );
    assert!((loss - val).abs() <= 1.5e-4, "human line: {line}");
}

/// `train { val, eval_every, eval_batches }` configure the validation loss as the flags do (the
/// file relative to the schedule's), and the flags override them.
#[test]
fn the_train_block_sets_validation_like_the_flags() {
    let dir = temp("val-keys");
    write(&dir, "val.bin", &llmc(&stream(3000, 256)));
    let sched = dir.join("keys.sched");
    let root = cli::root();
    std::fs::write(
        &sched,
        format!(
            "import \"{0}/schedules/models/tiny.sched\"\nimport \"{0}/schedules/clusters/cpu.sched\"\n\
             schedule s {{ model = tiny_gpt  cluster = cpu4  nodes = 1  preset = zero3\n\
             train {{ steps = 3  lr = 1e-3  val = \"val.bin\"  eval_every = 2  eval_batches = 2 }} }}\n",
            root.display()
        ),
    )
    .unwrap();
    let vals = |args: &[&str]| -> Vec<Option<f64>> {
        let out = schedrun(args);
        assert!(out.status.success(), "{}", stderr(&out));
        json_lines(&out)[..3]
            .iter()
            .map(|l| l.get("val_loss").and_then(|v| v.as_f64()))
            .collect()
    };
    let val = dir.join("val.bin");
    let keys = vals(&[s(&sched), "--json"]);
    let flags = vals(&[
        s(&sched),
        "--json",
        "--val",
        s(&val),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
    ]);
    assert!(
        keys[0].is_none() && keys[1].is_some() && keys[2].is_some(),
        "{keys:?}"
    );
    assert_eq!(keys, flags);
    // The flag overrides the key: every step.
    let every = vals(&[s(&sched), "--json", "--eval-every", "1"]);
    assert!(every.iter().all(Option::is_some), "{every:?}");
    assert_eq!(every[1], keys[1]);
}

/// The issue's run: a GPT-2-shaped model (learned positions, LayerNorm, GELU, tied head) with a
/// vocabulary past a byte's trains on an llm.c shard with warmup and cosine decay under ZeRO-3 on
/// the CPU backend, printing the validation loss, and plots both curves.
#[test]
fn a_gpt2_shaped_model_trains_on_a_shard_under_zero3_with_validation_and_a_plot() {
    let dir = temp("gpt2");
    let sched = dir.join("gpt2_tokens.sched");
    std::fs::write(
        &sched,
        r#"
model gpt2_tokens {
    dtype = fp32  optimizer = adamw  seq_len = 32  micro_batch = 2
    layer embed    = embedding(vocab = 512, hidden = 64, positions = learned)
    layer block[2] = transformer(hidden = 64, heads = 4, ffn = 256)
    layer head     = lm_head(hidden = 64, vocab = 512, tied = true)
}
cluster cpu4 {
    nodes = 1  gpus_per_node = 4  gpu_memory = 4 GiB  peak_flops = 100 GFLOPS  gemm_workspace = 0 B
    intra_node { bandwidth = 10 GB/s  latency = 1 us }
    inter_node { bandwidth = 1 Gbps  latency = 50 us }
}
schedule gpt2_zero3 {
    model = gpt2_tokens  cluster = cpu4  nodes = 1  micro_steps = 1  preset = zero3
    train { steps = 40  lr = 3e-3  seed = 0  warmup = 5  decay = cosine  min_lr = 3e-4 }
}
"#,
    )
    .unwrap();
    let all = stream(30_000, 512);
    assert!(all.iter().any(|&t| t >= 256), "tokens past a byte");
    let train = write(&dir, "train.bin", &llmc(&all[..24_000]));
    let val = write(&dir, "val.bin", &llmc(&all[24_000..]));
    let plot = dir.join("loss.svg");
    let out = schedrun(&[
        s(&sched),
        "--json",
        "--data",
        s(&train),
        "--val",
        s(&val),
        "--eval-every",
        "10",
        "--eval-batches",
        "4",
        "--plot",
        s(&plot),
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 41);
    let val_losses: Vec<(u64, f64)> = lines[..40]
        .iter()
        .filter_map(|l| Some((l["step"].as_u64()?, l["val_loss"].as_f64()?)))
        .collect();
    let steps: Vec<u64> = val_losses.iter().map(|v| v.0).collect();
    assert_eq!(steps, [10, 20, 30, 40]);
    // Warmup then cosine: rising to 3e-3 at step 5, falling to min_lr at the last.
    let lr: Vec<f64> = lines[..40]
        .iter()
        .map(|l| l["lr"].as_f64().unwrap())
        .collect();
    assert!(
        (lr[0] - 6e-4).abs() < 1e-12 && (lr[4] - 3e-3).abs() < 1e-12,
        "{lr:?}"
    );
    assert!(lr[39] < lr[20] && lr[20] < lr[5], "{lr:?}");
    // It learns: on held-out tokens the loss falls well below uniform's ln 512 = 6.24.
    let (first, last) = (val_losses[0].1, val_losses[3].1);
    assert!(
        last < first && last < 5.0,
        "validation losses {val_losses:?}"
    );
    assert!(
        err.contains("(llm.c shard, uint16 tokens): 24000 tokens"),
        "{err}"
    );
    // The plot: an SVG with the training line (40 points) and the validation line (4), and a
    // legend naming both.
    let svg = std::fs::read_to_string(&plot).unwrap();
    check_plot(&svg, 40, 4);
}

/// Points of each polyline drawn in `color`.
fn polylines(svg: &str, color: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .map(|p| &p[..p.find("/>").unwrap()])
        .filter(|p| p.contains(&format!("stroke=\"{color}\"")))
        .map(|p| {
            let at = p.find("points=\"").unwrap() + 8;
            let end = at + p[at..].find('"').unwrap();
            p[at..end].split_whitespace().count()
        })
        .collect()
}

fn check_plot(svg: &str, train: usize, val: usize) {
    assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<svg").count(), 1);
    for label in [
        "training loss",
        "validation loss",
        "step",
        "loss (nats per token)",
    ] {
        assert!(svg.contains(label), "{label}");
    }
    // The series' lines first, then the legend's short strokes (2 points).
    assert_eq!(polylines(svg, "#1F77B4"), [train, 2]);
    assert_eq!(polylines(svg, "#D62728"), [val, 2]);
    assert_eq!(
        svg.matches("<circle").count(),
        val,
        "a dot at each validation point"
    );
}

#[test]
fn the_plot_draws_both_series_and_only_training_without_validation() {
    let curve = LossCurve {
        train: (1..=30).map(|s| (s, 5.0 / (s as f64).sqrt())).collect(),
        val: vec![(10, 1.8), (20, 1.3), (30, 1.1)],
    };
    check_plot(&curve.svg("a run").unwrap(), 30, 3);
    let only = LossCurve {
        train: curve.train.clone(),
        val: vec![],
    };
    let svg = only.svg("a run").unwrap();
    assert_eq!(polylines(&svg, "#1F77B4"), [30, 2]);
    assert!(polylines(&svg, "#D62728").is_empty() && !svg.contains("validation loss"));
    // One step draws without a degenerate axis.
    let one = LossCurve {
        train: vec![(1, 5.5)],
        val: vec![(1, 5.6)],
    };
    assert!(one.svg("one step").unwrap().contains("validation loss"));
}

#[test]
fn an_unwritable_plot_is_refused_before_the_first_step() {
    let dir = temp("plot-unwritable");
    let plot = dir.join("no such folder").join("loss.svg");
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "2",
        "--plot",
        s(&plot),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--plot") && err.contains(s(&plot)), "{err}");
    assert!(out.stdout.is_empty());
    // Written after a run, and --eval-every without a validation file is refused (exit 1).
    let plot = dir.join("loss.svg");
    let out = schedrun(&[
        "schedules/tiny_cpu.sched",
        "--steps",
        "3",
        "--plot",
        s(&plot),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    check_plot_train_only(&std::fs::read_to_string(&plot).unwrap(), 3);
    let out = schedrun(&["schedules/tiny_cpu.sched", "--eval-every", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--val"), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
}

fn check_plot_train_only(svg: &str, train: usize) {
    assert!(svg.starts_with("<svg ") && svg.contains("training loss"));
    assert_eq!(polylines(svg, "#1F77B4"), [train, 2]);
}
