//! The shape of the code, checked: files stay small (STYLE.md: a few hundred lines; tests are
//! split by topic), and no two modules of one crate import each other, directly or around a
//! circle (a module and the modules inside it excepted: a parent holds what its children
//! share). What is inside `#[cfg(test)] mod tests { .. }` and comments does not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Lines a file may have.
const MAX_LINES: usize = 600;

fn crates() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_file_is_too_long() {
    let mut files = Vec::new();
    for krate in ["vdisk", "vdisk-cli", "vdisk-pcow-ffi"] {
        for dir in ["src", "tests"] {
            rust_files(&crates().join(krate).join(dir), &mut files);
        }
    }
    let long: Vec<String> = files
        .iter()
        .map(|f| (f, std::fs::read_to_string(f).unwrap().lines().count()))
        .filter(|&(_, n)| n > MAX_LINES)
        .map(|(f, n)| format!("{} ({n} lines)", f.display()))
        .collect();
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:#?}");
}

/// A module's path inside its crate, e.g. `["formats", "qcow2", "alloc"]`.
type Module = Vec<String>;

/// The crate's modules, by path, with their source.
fn modules(src: &Path) -> BTreeMap<Module, String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap().with_extension("");
            let mut m: Module = rel.iter().map(|c| c.to_string_lossy().into()).collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            (m, without_tests(&std::fs::read_to_string(&f).unwrap()))
        })
        .collect()
}

/// The source without comments and without `#[cfg(test)] mod .. { .. }` blocks.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let next = lines.peek().map_or("", |l| l.trim_start());
        if line.trim() == "#[cfg(test)]" && next.starts_with("mod ") && next.ends_with('{') {
            let mut depth = 0i64;
            for l in lines.by_ref() {
                depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
                if depth <= 0 {
                    break;
                }
            }
            continue;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// Paths named after `crate::`, `super::` or `self::` in `text`, with the braces of `use`
/// lists expanded.
fn paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    // One space between words, none around the punctuation of paths and `use` lists.
    let mut text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    for p in ["::", "{", "}", ","] {
        text = text
            .replace(&format!(" {p}"), p)
            .replace(&format!("{p} "), p);
    }
    for start in ["crate::", "super::", "self::"] {
        for (at, _) in text.match_indices(start) {
            let before = text[..at].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            expand(&text[at..], "", &mut out);
        }
    }
    out
}

/// Expands one path that starts `rest`, prefixed with `prefix`, into `out`.
fn expand(rest: &str, prefix: &str, out: &mut Vec<String>) {
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(rest.len());
    let (path, tail) = rest.split_at(end);
    let path = format!("{prefix}{path}");
    if let (Some(inner), true) = (tail.strip_prefix('{'), path.ends_with("::")) {
        let mut depth = 0;
        let mut item = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(&inner[item..i], &path, out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[item..i], &path, out);
                    item = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    out.push(path.trim_end_matches("::").to_string());
}

/// The module a path in `from` names: the longest prefix of it that is a module.
fn target(from: &Module, path: &str, known: &BTreeMap<Module, String>) -> Option<Module> {
    let mut parts = path.split("::").peekable();
    let mut base: Module = match parts.next()? {
        "crate" => Vec::new(),
        "self" => from.clone(),
        _ => {
            let mut b = from.clone();
            b.pop();
            while parts.peek() == Some(&"super") {
                parts.next();
                b.pop();
            }
            b
        }
    };
    let rest: Vec<&str> = parts.collect();
    let mut found = None;
    for p in rest {
        base.push(p.to_string());
        if known.contains_key(&base) {
            found = Some(base.clone());
        }
    }
    found.or_else(|| known.contains_key(&base).then(|| base.clone()))
}

/// A cycle of module imports, if the crate at `src` has one.
fn cycle(src: &Path) -> Option<Vec<Module>> {
    let known = modules(src);
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, text) in &known {
        for p in paths(text) {
            let Some(t) = target(m, &p, &known) else {
                continue;
            };
            if t.starts_with(m) || m.starts_with(&t) {
                continue;
            }
            edges.entry(m.clone()).or_default().insert(t);
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        m: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        stack: &mut Vec<Module>,
        done: &mut BTreeSet<Module>,
    ) -> Option<Vec<Module>> {
        if let Some(i) = stack.iter().position(|s| s == m) {
            return Some(stack[i..].to_vec());
        }
        if done.contains(m) {
            return None;
        }
        stack.push(m.clone());
        for t in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(t, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(m.clone());
        None
    }
    let mut done = BTreeSet::new();
    known
        .keys()
        .find_map(|m| visit(m, &edges, &mut Vec::new(), &mut done))
}

#[test]
fn modules_do_not_import_each_other() {
    for krate in ["vdisk", "vdisk-cli", "vdisk-pcow-ffi"] {
        let found = cycle(&crates().join(krate).join("src"));
        let names = found.map(|c| c.iter().map(|m| m.join("::")).collect::<Vec<_>>());
        assert_eq!(names, None, "{krate}: modules importing each other");
    }
}

#[test]
fn a_cycle_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::X;\n").unwrap();
    std::fs::write(src.join("b.rs"), "use super::{c::{Y, Z}, d};\n").unwrap();
    std::fs::write(src.join("c.rs"), "fn f() { crate::a::g() }\n").unwrap();
    let c = cycle(src).expect("a -> b -> c -> a");
    assert_eq!(c.len(), 3, "{c:?}");
    std::fs::write(src.join("c.rs"), "// crate::a::g\n").unwrap();
    assert_eq!(cycle(src), None);
}
