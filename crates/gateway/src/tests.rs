//! Crate-wide checks of the code's shape: no file over [`MAX_LINES`], and modules that never
//! import each other in a circle (every path from a route runs downhill).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A file longer than this holds more than one concern.
const MAX_LINES: usize = 400;

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

fn sources() -> (PathBuf, Vec<PathBuf>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(
        files.len() > 15,
        "read only {} files under {}",
        files.len(),
        src.display()
    );
    (src, files)
}

/// A file's module path: `policy/kv.rs` → `["policy", "kv"]`, `tokenize/mod.rs` →
/// `["tokenize"]`, `lib.rs` → `[]`.
fn module_of(relative: &Path) -> Vec<String> {
    let mut path: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some(last) = path.pop() {
        let stem = last.strip_suffix(".rs").unwrap_or(&last);
        if stem != "mod" && stem != "lib" {
            path.push(stem.to_string());
        }
    }
    path
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The module paths a file of module `own` names, comments left out: `crate::a::b`,
/// `super::a`, `self::a`, and `child::a` for a `mod child;` it declares. Paths are given
/// whole (`crate::a::Item` → `["a", "Item"]`); the caller keeps the longest known module.
/// Inside an inline `mod name { … }` (a file's tests), `super` and `self` are relative to it.
fn named_paths(own: &[String], text: &str) -> Vec<Vec<String>> {
    let code: Vec<&str> = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect();
    let children: BTreeSet<String> = code
        .iter()
        .filter_map(|line| {
            let line = line.trim().strip_prefix("pub ").unwrap_or(line.trim());
            let name = line.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.trim().to_string())
        })
        .collect();
    let mut named = Vec::new();
    // The inline modules the line is in, each with the brace depth it opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    for line in code {
        let trimmed = line.trim().strip_prefix("pub ").unwrap_or(line.trim());
        if let Some(name) = trimmed
            .strip_prefix("mod ")
            .and_then(|rest| rest.strip_suffix('{'))
        {
            inline.push((name.trim().to_string(), depth));
        }
        let here: Vec<String> = own
            .iter()
            .cloned()
            .chain(inline.iter().map(|(name, _)| name.clone()))
            .collect();
        for (at, _) in line.match_indices("::") {
            // The first segment of a path: the word before `::`, not itself after a `::`.
            let head_start = line[..at]
                .char_indices()
                .rev()
                .take_while(|(_, c)| is_ident(*c))
                .last()
                .map_or(at, |(i, _)| i);
            let head = &line[head_start..at];
            let before = line[..head_start].chars().next_back();
            if head.is_empty() || before.is_some_and(|c| is_ident(c) || c == ':' || c == '$') {
                continue;
            }
            let mut base: Vec<String> = match head {
                "crate" => Vec::new(),
                "super" => here[..here.len().saturating_sub(1)].to_vec(),
                "self" => here.clone(),
                child if children.contains(child) && inline.is_empty() => {
                    let mut path = own.to_vec();
                    path.push(child.to_string());
                    path
                }
                _ => continue,
            };
            let segments = line[at + 2..]
                .split("::")
                .map(|segment| {
                    segment
                        .chars()
                        .take_while(|c| is_ident(*c))
                        .collect::<String>()
                })
                .take_while(|segment| !segment.is_empty());
            let mut leading = true;
            for segment in segments {
                // `super::super::x`: each further `super` goes up one more.
                leading &= segment == "super";
                if leading {
                    base.pop();
                } else {
                    base.push(segment);
                }
            }
            named.push(base);
        }
        depth += line.matches('{').count();
        depth = depth.saturating_sub(line.matches('}').count());
        while inline
            .last()
            .is_some_and(|(_, opened_at)| *opened_at >= depth)
        {
            inline.pop();
        }
    }
    named
}

/// The module graph: each module file's module, and the modules it uses.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let (src, files) = sources();
    let modules: Vec<(Vec<String>, String)> = files
        .iter()
        .filter_map(|file| {
            let relative = file.strip_prefix(&src).ok()?;
            let text = std::fs::read_to_string(file).ok()?;
            Some((module_of(relative), text))
        })
        .filter(|(module, _)| !module.is_empty() && module != &["tests"])
        .collect();
    let known: BTreeSet<Vec<String>> = modules.iter().map(|(m, _)| m.clone()).collect();
    let mut graph = BTreeMap::new();
    for (module, text) in &modules {
        let mut uses = BTreeSet::new();
        for mut path in named_paths(module, text) {
            // The longest prefix that is a module of its own file.
            while !path.is_empty() && !known.contains(&path) {
                path.pop();
            }
            if !path.is_empty() && &path != module {
                uses.insert(path.join("::"));
            }
        }
        graph.insert(module.join("::"), uses);
    }
    graph
}

/// A circle of the graph, if there is one: its modules in order, the first repeated last.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first, with the modules of the current path marked; a used module on the path
    // closes a circle.
    fn visit(
        module: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut circle = path[at..].to_vec();
            circle.push(module.to_string());
            return Some(circle);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_string());
        for used in graph.get(module).into_iter().flatten() {
            if let Some(circle) = visit(used, graph, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(module.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(module, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_file_is_over_the_line_limit() {
    let (src, files) = sources();
    let long: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let lines = std::fs::read_to_string(file).ok()?.lines().count();
            let relative = file.strip_prefix(&src).ok()?;
            (lines > MAX_LINES).then(|| format!("{}: {lines} lines", relative.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines (split by concern): {}",
        long.join(", ")
    );
}

#[test]
fn modules_never_use_each_other_in_a_circle() {
    let graph = module_graph();
    // The graph is read, not empty: the routes reach the dispatch, a policy the booking.
    assert!(graph["routes"].contains("upstream"), "{graph:#?}");
    assert!(graph["policy"].contains("booking"), "{graph:#?}");
    assert!(
        graph["tokenize::model"].contains("tokenize::template"),
        "{graph:#?}"
    );
    if let Some(circle) = find_circle(&graph) {
        panic!("modules in a circle: {}", circle.join(" → "));
    }
}

#[test]
fn paths_are_read_from_code_and_resolved_from_the_file() {
    let own = vec!["tokenize".to_string(), "model".to_string()];
    let text = "use super::template::{A, B};\nuse crate::error::GatewayError;\n/// see [`crate::api`]\nlet x = kvroute_crate::y::z(); // crate::http\nmacro_rules! m { () => { $crate::sync::X } }\nuse std::sync::Arc;";
    let named: Vec<String> = named_paths(&own, text)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(named, ["tokenize::template", "error::GatewayError"]);
    let tests = "mod tests {\n    use super::*;\n    use super::super::template::X;\n}\nuse super::remote::Y;";
    let named: Vec<String> = named_paths(&own, tests)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        named,
        [
            "tokenize::model",
            "tokenize::template::X",
            "tokenize::remote::Y"
        ]
    );
    let own = vec!["policy".to_string()];
    let named = named_paths(
        &own,
        "pub mod kv;\nuse kv::CacheAware;\nuse self::round_robin::X;",
    );
    assert_eq!(
        named,
        [
            vec!["policy", "kv", "CacheAware"],
            vec!["policy", "round_robin", "X"]
        ]
    );
}

#[test]
fn a_circle_is_found_and_a_tree_has_none() {
    let graph = |edges: &[(&str, &str)]| {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in edges {
            graph
                .entry(from.to_string())
                .or_default()
                .insert(to.to_string());
            graph.entry(to.to_string()).or_default();
        }
        graph
    };
    let diamond = graph(&[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]);
    assert_eq!(find_circle(&diamond), None);
    let circle = graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
    assert_eq!(
        find_circle(&circle),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}
