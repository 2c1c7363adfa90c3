//! Crate-wide checks of the code's shape.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The top-level modules in dependency order: each may use (`crate::…`) only modules listed
/// before it, so the modules never import each other in a loop. A new module must be placed
/// here.
const ORDER: &[&str] = &[
    "event",
    "hash",
    "speed",
    "index",
    "load",
    "pending",
    "approx",
    "schedule",
    "error",
    "admission",
    "selector",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn ident(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The modules a source text names as `crate::<module>` or `crate::{<module>, …}`, comments
/// left out.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (at, _) in code.match_indices("crate::") {
            // `$crate::` and `other_crate::` are not this crate's paths.
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            let rest = &code[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = group.split('}').next().unwrap_or("");
                named.extend(
                    group
                        .split(',')
                        .map(|item| ident(item.trim()))
                        .filter(|name| !name.is_empty()),
                );
            } else {
                let name = ident(rest);
                if !name.is_empty() {
                    named.insert(name);
                }
            }
        }
    }
    named
}

#[test]
fn modules_depend_in_one_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let rank = |module: &str| ORDER.iter().position(|m| *m == module);
    let mut problems = Vec::new();
    for file in &files {
        let Ok(relative) = file.strip_prefix(&src) else {
            continue;
        };
        let Some(first) = relative.components().next() else {
            continue;
        };
        let first = first.as_os_str().to_string_lossy();
        let module = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        if module == "lib" || module == "tests" {
            continue;
        }
        let Some(own) = rank(&module) else {
            problems.push(format!("module `{module}` is not in ORDER"));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for used in crate_paths(&text) {
            match rank(&used) {
                Some(r) if r < own || used == module => {}
                Some(_) => problems.push(format!(
                    "{}: `{module}` uses `crate::{used}`, which comes after it in ORDER",
                    relative.display()
                )),
                // Items of the crate root.
                None => {}
            }
        }
    }
    assert!(
        files.len() > 10,
        "read only {} files under {}",
        files.len(),
        src.display()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn crate_paths_are_read_from_code_only() {
    let text = "use crate::hash::PromptHashes;\n/// see [`crate::index`]\nlet x = crate::load::LoadTracker::new(); // crate::approx\nuse crate::{error, event::Rank};\nmacro_rules! m { () => { $crate::selector::X } }";
    let named: Vec<String> = crate_paths(text).into_iter().collect();
    assert_eq!(named, ["error", "event", "hash", "load"]);
}
