//! Crate-wide checks of the code's shape.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The top-level modules in dependency order: each may use (`crate::…`) only modules listed
/// before it, so the modules never import each other in a loop. A new module must be placed
/// here. `admission::queue` (the queue's data) ranks on its own, below the state that holds
/// it; the rest of `admission` (which drives the state) above.
const ORDER: &[&str] = &[
    "courtesy",
    "error",
    "types",
    "degraded",
    "metrics",
    "ingest",
    "sync",
    "admission::queue",
    "config",
    "state",
    "engine_load",
    "admission",
    "api",
    "http",
    "sync_tasks",
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

/// Modules ranked on their own inside a top-level module (see [`ORDER`]).
const SPLIT: &[&str] = &["admission::queue"];

/// The module of a path below the crate root (`admission/queue.rs` → `admission::queue`,
/// `api/select.rs` → `api`), or of a path named in code (`admission::queue::X`).
fn module_of(path: &[&str]) -> String {
    let top = path.first().copied().unwrap_or("");
    if let Some(second) = path.get(1) {
        let split = format!("{top}::{second}");
        if SPLIT.contains(&split.as_str()) {
            return split;
        }
    }
    top.to_string()
}

/// The modules a source text names as `crate::<module>`, comments left out.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (at, _) in code.match_indices("crate::") {
            // `$crate::` and `kvroute_crate::` are not this crate's paths.
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            let path: String = code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            if !segments.is_empty() {
                named.insert(module_of(&segments));
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
        let parts: Vec<String> = relative
            .components()
            .map(|c| {
                let part = c.as_os_str().to_string_lossy();
                part.strip_suffix(".rs").unwrap_or(&part).to_string()
            })
            .collect();
        if parts.is_empty() {
            continue;
        }
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        let module = module_of(&parts);
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
                // A split module's parent may use it (`admission` uses `admission::queue`).
                Some(r) if r < own || used == module => {}
                Some(_) => problems.push(format!(
                    "{}: `{module}` uses `crate::{used}`, which comes after it in ORDER",
                    relative.display()
                )),
                // Items of the crate root (re-exports such as `crate::AppState`).
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
    let text = "use crate::state::AppState;\n/// see [`crate::api`]\nlet x = crate::metrics::Metrics::new(); // crate::http\nmacro_rules! m { () => { $crate::sync::X } }\nuse crate::admission::queue::Route;\nuse crate::admission::Admission;";
    let named: Vec<String> = crate_paths(text).into_iter().collect();
    assert_eq!(named, ["admission", "admission::queue", "metrics", "state"]);
}
