//! Token data: prepare writes what it claims, formats round-trip, corrupt files are rejected, Python's
//! nanoGPT-style files are read as they are.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use nanodist::data::{
    self, open_source, OutputFormat, PrepareOptions, TokenFile, Tokenizer, TokenizerKind,
};

/// A corpus we make ourselves: numbered documents with varied words, one file each, plus a JSONL file.
fn make_corpus(dir: &Path, n_docs: usize) -> Vec<String> {
    let words = [
        "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "über", "naïve", "🦀",
    ];
    let mut docs = Vec::new();
    std::fs::create_dir_all(dir.join("texts/sub")).unwrap();
    for i in 0..n_docs {
        let doc: String = (0..(20 + i * 7 % 50))
            .map(|j| words[(i * 31 + j * 17) % words.len()])
            .collect::<Vec<_>>()
            .join(if i % 3 == 0 { " " } else { "\n" });
        let sub = if i % 2 == 0 { "texts" } else { "texts/sub" };
        std::fs::write(dir.join(format!("{sub}/doc{i:03}.txt")), &doc).unwrap();
        docs.push(doc);
    }
    docs
}

fn opts(inputs: Vec<PathBuf>, output: PathBuf) -> PrepareOptions {
    PrepareOptions {
        inputs,
        output,
        tokenizer: TokenizerKind::Gpt2,
        val_fraction: 0.2,
        seed: 7,
        format: OutputFormat::Both,
        json_key: "text".into(),
        threads: Some(2),
        progress: false,
    }
}

fn read_all(f: &TokenFile) -> Vec<u32> {
    let mut v = vec![0; f.len()];
    f.read(0, &mut v);
    v
}

#[test]
fn prepare_writes_every_document_once_with_eot() {
    let dir = tempfile::tempdir().unwrap();
    let docs = make_corpus(dir.path(), 40);
    let report = data::prepare(&opts(
        vec![dir.path().join("texts")],
        dir.path().join("out"),
    ))
    .unwrap();
    let m = &report.meta;
    assert_eq!(m.train.documents + m.val.documents, 40);
    assert!(m.val.documents > 0 && m.train.documents > 0);
    let expected: u64 = docs
        .iter()
        .map(|d| Tokenizer::Gpt2.encode(d).unwrap().len() as u64 + 1)
        .sum();
    assert_eq!(m.train.tokens + m.val.tokens, expected);

    let out = dir.path().join("out");
    let train = TokenFile::open_nanogpt(&out.join("train.bin"), false).unwrap();
    let val = TokenFile::open_nanogpt(&out.join("val.bin"), true).unwrap();
    let (t, v) = (read_all(&train), read_all(&val));
    assert_eq!(t.len() as u64, m.train.tokens);
    let eots = t.iter().chain(&v).filter(|&&x| x == 50256).count();
    assert_eq!(eots, 40);
    assert_eq!(*t.last().unwrap(), 50256);
    // Every document appears whole in one split: decode each split's documents and compare as sets.
    let mut seen: Vec<String> = t
        .split(|&x| x == 50256)
        .chain(v.split(|&x| x == 50256))
        .filter(|d| !d.is_empty())
        .map(|d| Tokenizer::Gpt2.decode(d).unwrap())
        .collect();
    let mut want = docs.clone();
    seen.sort();
    want.sort();
    assert_eq!(seen, want);
}

#[test]
fn output_is_deterministic_across_thread_counts_and_depends_on_seed() {
    let dir = tempfile::tempdir().unwrap();
    make_corpus(dir.path(), 30);
    let input = vec![dir.path().join("texts")];
    let mut a = opts(input.clone(), dir.path().join("a"));
    a.threads = Some(1);
    let mut b = opts(input.clone(), dir.path().join("b"));
    b.threads = Some(2);
    let mut c = opts(input, dir.path().join("c"));
    c.seed = 8;
    for o in [&a, &b, &c] {
        data::prepare(o).unwrap();
    }
    let read = |d: &str, f: &str| std::fs::read(dir.path().join(d).join(f)).unwrap();
    assert_eq!(read("a", "train.bin"), read("b", "train.bin"));
    assert_eq!(read("a", "val.bin"), read("b", "val.bin"));
    assert_ne!(read("a", "val.bin"), read("c", "val.bin"));
}

#[test]
fn megatron_files_read_back_identically() {
    let dir = tempfile::tempdir().unwrap();
    make_corpus(dir.path(), 25);
    data::prepare(&opts(
        vec![dir.path().join("texts")],
        dir.path().join("out"),
    ))
    .unwrap();
    let out = dir.path().join("out");
    for split in ["train", "val"] {
        let nano = TokenFile::open_nanogpt(&out.join(format!("{split}.bin")), false).unwrap();
        for name in [
            format!("{split}_text_document"),
            format!("{split}_text_document.bin"),
            format!("{split}_text_document.idx"),
        ] {
            let mega = open_source(&out.join(&name), false).unwrap();
            assert_eq!(read_all(&mega), read_all(&nano), "{name}");
            let docs = mega.documents.as_ref().unwrap();
            assert_eq!(*docs.last().unwrap() as usize, mega.len());
            // Each document ends with EOT.
            let toks = read_all(&mega);
            for w in docs.windows(2).filter(|w| w[1] > w[0]) {
                assert_eq!(toks[w[1] as usize - 1], 50256);
            }
        }
    }
}

#[test]
fn handcrafted_corrupt_megatron_pairs_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    make_corpus(dir.path(), 10);
    let mut o = opts(vec![dir.path().join("texts")], dir.path().join("out"));
    o.format = OutputFormat::Megatron;
    o.val_fraction = 0.0;
    data::prepare(&o).unwrap();
    let prefix = dir.path().join("out/train_text_document");
    let bin = std::fs::read(prefix.with_extension("bin")).unwrap();
    let idx = std::fs::read(prefix.with_extension("idx")).unwrap();
    let check = |bin_bytes: &[u8], idx_bytes: &[u8], why: &str| {
        let p = dir.path().join("bad");
        std::fs::write(p.with_extension("bin"), bin_bytes).unwrap();
        std::fs::write(p.with_extension("idx"), idx_bytes).unwrap();
        let err = format!("{:#}", open_source(&p, false).unwrap_err());
        assert!(err.contains(why), "{why}: {err}");
        assert!(err.contains("bad."), "error must name the file: {err}");
    };
    check(&bin[..bin.len() - 2], &idx, "truncated or mismatched");
    check(&bin, &idx[..idx.len() - 5], "truncated");
    check(&bin, b"TNTIDX\x00\x00 legacy", "legacy");
    let mut bad_ptr = idx.clone();
    let s = u64::from_le_bytes(idx[18..26].try_into().unwrap()) as usize;
    bad_ptr[34 + 4 * s + 8] ^= 0x10; // second pointer
    check(&bin, &bad_ptr, "starts at byte");
}

#[test]
fn odd_sized_and_out_of_vocab_nanogpt_files_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("odd.bin");
    std::fs::write(&p, [1u8, 0, 2]).unwrap();
    let err = format!("{:#}", TokenFile::open_nanogpt(&p, false).unwrap_err());
    assert!(
        err.contains("odd byte count") && err.contains("odd.bin"),
        "{err}"
    );
    let p = dir.path().join("big.bin");
    let toks: Vec<u8> = [5u16, 60000, 7]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(&p, toks).unwrap();
    let f = TokenFile::open_nanogpt(&p, false).unwrap();
    let err = format!("{:#}", f.check_vocab(50304, f.extremes()).unwrap_err());
    assert!(err.contains("token 60000 at position 1"), "{err}");
    assert_eq!(f.extremes(), (5, 60000));
    f.check_vocab(65536, f.extremes()).unwrap();
    let err = format!(
        "{:#}",
        open_source(&dir.path().join("missing.bin"), false).unwrap_err()
    );
    assert!(err.contains("missing.bin"), "{err}");
}

/// A nanoGPT-style file written by numpy, exactly as nanoGPT's prepare.py does, is read identically.
#[test]
fn nanogpt_file_written_by_python_is_read_identically() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("py.bin");
    let script = format!(
        "import numpy as np\nids = [(i * 7919) % 50257 for i in range(10000)] + [50256]\n\
         np.array(ids, dtype=np.uint16).tofile({:?})\n",
        p.display().to_string()
    );
    let out = Command::new("python3").arg("-c").arg(&script).output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("No module named 'numpy'") => {
            common::skip_python("Python numpy not installed");
            return;
        }
        other => panic!("python failed: {other:?}"),
    }
    let want: Vec<u32> = (0..10000u32)
        .map(|i| (i * 7919) % 50257)
        .chain([50256])
        .collect();
    for in_memory in [false, true] {
        let f = TokenFile::open_nanogpt(&p, in_memory).unwrap();
        assert_eq!(read_all(&f), want);
    }
}

#[test]
fn jsonl_inputs_use_the_json_key_and_report_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("docs.jsonl");
    let lines: Vec<String> = (0..30)
        .map(|i| format!("{{\"body\": \"document number {i} ü\", \"id\": {i}}}"))
        .collect();
    std::fs::write(&p, lines.join("\n") + "\n\n").unwrap();
    let mut o = opts(vec![p.clone()], dir.path().join("out"));
    o.json_key = "body".into();
    let m = data::prepare(&o).unwrap().meta;
    assert_eq!(m.train.documents + m.val.documents, 30);

    o.json_key = "text".into();
    let err = format!("{:#}", data::prepare(&o).unwrap_err());
    assert!(
        err.contains("docs.jsonl:1") && err.contains("\"text\""),
        "{err}"
    );
    std::fs::write(&p, "{\"body\": \"ok\"}\nnot json\n").unwrap();
    o.json_key = "body".into();
    let err = format!("{:#}", data::prepare(&o).unwrap_err());
    assert!(err.contains("docs.jsonl:2"), "{err}");
}

#[test]
fn one_document_falls_back_to_a_token_split_and_char_tokenizer_works() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("one.txt");
    let text = "to be or not to be, that is the question. ".repeat(50);
    std::fs::write(&p, &text).unwrap();
    let mut o = opts(vec![p], dir.path().join("out"));
    o.tokenizer = TokenizerKind::Char;
    o.val_fraction = 0.1;
    let m = data::prepare(&o).unwrap().meta;
    assert_eq!(m.split, "tokens");
    let total = text.chars().count() as u64 + 1;
    assert_eq!(m.train.tokens + m.val.tokens, total);
    assert_eq!(m.val.tokens, (total as f64 * 0.1).ceil() as u64);
    assert_eq!(m.vocab_size, m.tokenizer.vocab_size());
    let train = TokenFile::open_nanogpt(&dir.path().join("out/train.bin"), false).unwrap();
    let text = m.tokenizer.decode(&read_all(&train)).unwrap();
    assert!(text.starts_with("to be or not"));
    // The Megatron index agrees with the truncated split.
    let mega = open_source(&dir.path().join("out/val_text_document"), false).unwrap();
    assert_eq!(mega.len() as u64, m.val.tokens);
}

#[test]
fn cli_prepare_bad_input_exits_2() {
    let exe = env!("CARGO_BIN_EXE_nanodist");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(exe)
        .args(["prepare", "--input", "/nonexistent/x.txt", "--output"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.txt"));
    let bad = dir.path().join("latin1.txt");
    std::fs::write(&bad, [b'a', 0xe9, b'b']).unwrap();
    let out = Command::new(exe)
        .args(["prepare", "--input"])
        .arg(&bad)
        .arg("--output")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not UTF-8"));
}

/// Writes `n` parquet shards of 25 documents each, with an `id` and a `text` column (the Hugging Face
/// dataset layout), as `dir/train-0000N.parquet`; returns the documents in order.
#[cfg(feature = "parquet")]
fn write_parquet_shards(dir: &Path, n: usize) -> Vec<String> {
    use std::sync::Arc;

    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    std::fs::create_dir_all(dir).unwrap();
    let mut all = Vec::new();
    for shard in 0..n {
        let docs: Vec<String> = (0..25)
            .map(|i| format!("shard {shard} document {i}: naïve text 🦀"))
            .collect();
        let schema = Arc::new(
            parse_message_type("message s { REQUIRED INT64 id; REQUIRED BYTE_ARRAY text (UTF8); }")
                .unwrap(),
        );
        let props = Arc::new(
            WriterProperties::builder()
                .set_compression(Compression::SNAPPY)
                .build(),
        );
        let file = std::fs::File::create(dir.join(format!("train-{shard:05}.parquet"))).unwrap();
        let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>()
            .write_batch(&(0..25).collect::<Vec<i64>>(), None, None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = docs.iter().map(|d| ByteArray::from(d.as_str())).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        all.extend(docs);
    }
    all
}

/// Parquet shards with a `text` column (Hugging Face dataset layout), written with the parquet crate.
#[cfg(feature = "parquet")]
#[test]
fn parquet_shards_are_read_by_column() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    let all = write_parquet_shards(&shards, 2);
    let m = data::prepare(&opts(vec![shards.clone()], dir.path().join("out")))
        .unwrap()
        .meta;
    assert_eq!(m.train.documents + m.val.documents, 50);
    let expected: u64 = all
        .iter()
        .map(|d| Tokenizer::Gpt2.encode(d).unwrap().len() as u64 + 1)
        .sum();
    assert_eq!(m.train.tokens + m.val.tokens, expected);
    let mut o = opts(vec![shards], dir.path().join("out2"));
    o.json_key = "body".into();
    let err = format!("{:#}", data::prepare(&o).unwrap_err());
    assert!(
        err.contains("train-00000.parquet: row 1") && err.contains("no column \"body\""),
        "{err}"
    );
}

/// scripts/data/openwebtext.sh on local parquet shards in the Hub conversion's layout (no network in tests):
/// the files it writes are `nanodist prepare`'s on the same shards, with the seed configs' tokenizer.
#[cfg(feature = "parquet")]
#[test]
fn the_openwebtext_script_prepares_parquet_shards_as_the_seed_configs_expect() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("hub/plain_text/train");
    write_parquet_shards(&shards, 3);
    let out = dir.path().join("openwebtext");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("scripts/data/openwebtext.sh");
    let run = |args: &[&str]| {
        Command::new("bash")
            .arg(&script)
            .args(args)
            .env("NANODIST", env!("CARGO_BIN_EXE_nanodist"))
            .output()
            .unwrap()
    };
    let from = dir.path().join("hub");
    let done = run(&[
        "--from",
        from.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--val-fraction",
        "0.1",
    ]);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let mut o = opts(vec![from], dir.path().join("direct"));
    (o.val_fraction, o.seed, o.format) = (0.1, 2357, OutputFormat::Nanogpt);
    o.threads = None;
    let direct = data::prepare(&o).unwrap().meta;
    assert_eq!(direct.tokenizer.name(), "gpt2");
    for file in ["train.bin", "val.bin"] {
        assert!(
            std::fs::read(out.join(file)).unwrap()
                == std::fs::read(dir.path().join("direct").join(file)).unwrap(),
            "{file} differs from nanodist prepare's"
        );
    }
    let bad = run(&["--nope"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// Non-IID data: one source with a one-row blend is today's sampler bit for bit; shards and per-worker
/// blends train, resume exactly, and the rows say what each worker read, with batches sampled ahead or
/// in place alike.
#[test]
fn workers_with_their_own_data_resume_exactly_and_log_their_sources() {
    let d = tempfile::tempdir().unwrap();
    common::make_data(d.path());
    let run =
        |name: &str, set: &[&str]| common::rows_of(&common::train_tiny(d.path(), name, 2, set));
    let shared = run("shared", &[]);
    let one_row = run(
        "one",
        &[r#"worker_data={ name = "blend", weights = [[2.0]] }"#],
    );
    assert_eq!(
        shared.iter().map(common::exact).collect::<Vec<_>>(),
        one_row.iter().map(common::exact).collect::<Vec<_>>()
    );
    assert!(shared.iter().all(|r| r.source_windows.is_none()));
    let (train, val) = (d.path().join("train.bin"), d.path().join("val.bin"));
    let sources = format!(
        "train_data=[{{ path = {:?} }}, {{ path = {:?} }}]",
        train.display().to_string(),
        val.display().to_string()
    );
    let cases = [
        vec![r#"worker_data={ name = "shard" }"#.to_string()],
        vec![
            sources,
            r#"worker_data={ name = "blend", weights = [[1.0, 0.0], [0.0, 1.0]] }"#.into(),
        ],
    ];
    for (i, case) in cases.iter().enumerate() {
        let mut set: Vec<&str> = case.iter().map(String::as_str).collect();
        set.push("train.backend=\"diloco\"");
        set.push("train.diloco={ sync_every = 4 }");
        let full = run(&format!("full{i}"), &set);
        // Batches sampled in place are the loader's, and so are their windows' sources.
        let in_place = run(
            &format!("in_place{i}"),
            &[&set[..], &["prefetch=false"]].concat(),
        );
        let of = |rows: &[nanodist::metrics::Row]| {
            let exact: Vec<_> = rows.iter().map(common::exact).collect();
            (
                exact,
                rows.iter()
                    .map(|r| r.source_windows.clone())
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(of(&full), of(&in_place), "{case:?}");
        let mut first = set.clone();
        first.push("train.exit_interval=5");
        run(&format!("cut{i}"), &first);
        let cut = run(&format!("cut{i}"), &set);
        assert_eq!(
            full.iter().map(common::exact).collect::<Vec<_>>(),
            cut.iter().map(common::exact).collect::<Vec<_>>(),
            "{case:?}"
        );
        assert_ne!(
            full[3].train_loss, shared[3].train_loss,
            "{case:?}: other data"
        );
        let windows = full.iter().filter_map(|r| r.source_windows.clone());
        let total: Vec<Vec<u64>> = windows.fold(Vec::new(), |acc, w| match acc.is_empty() {
            true => w,
            false => acc
                .iter()
                .zip(&w)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x + y).collect())
                .collect(),
        });
        assert_eq!(total.len(), 2, "{case:?}: a count per worker");
        if i == 1 {
            assert!(total[0][1] == 0 && total[1][0] == 0 && total[0][0] > 0 && total[1][1] > 0);
        }
    }
}
