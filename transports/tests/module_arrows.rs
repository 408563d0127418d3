//! No arrow runs back up: inside `transports/src`, `worker/src`, `worker/harness/src` and
//! `worker/cli/src`, no module imports a module that depends on it (no two files importing each
//! other, no longer cycle).
//!
//! The test reads the sources, builds each crate's module tree from its `mod` declarations,
//! and draws an arrow from a file to every file whose items it names: its `use` declarations
//! (re-exports included) and the `crate::`, `super::`, `self::` and child-module paths in its
//! code. A name imported through a re-export (`use crate::Rank`, re-exported by `lib.rs` from
//! `wire.rs`) points at the file that defines it, not at the facade; declaring a module
//! (`mod x;`) is no arrow. Comments, string literals and `#[cfg(test)]` items are left out
//! (tests may reach anywhere). Any cycle of arrows fails the test (there is no list of
//! exceptions), printed with the line that draws each arrow.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

/// One module of a crate (a file, or an inline `mod x { .. }` inside one).
#[derive(Debug, Default)]
struct Module {
    /// The file it lives in, relative to the repository.
    file: String,
    /// Child modules by name.
    children: BTreeSet<String>,
    /// Names bound by its `use` declarations: binding -> full path as written.
    bindings: BTreeMap<String, Vec<String>>,
    /// Every path it names (use declarations expanded, and paths in code), with the text
    /// that names it.
    refs: Vec<(Vec<String>, String)>,
}

/// A crate: its modules by path (`[]` is the root).
type Tree = BTreeMap<Vec<String>, Module>;

/// Source text with comments and string and character literals blanked out.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if let Some((skip, hashes)) =
            raw_string_start(&b[i..]).filter(|_| (c == b'r' || c == b'b') && !prev_is_ident(b, i))
        {
            i += skip;
            // Past the opening quote: find the quote followed by `hashes` hashes.
            while i < b.len() {
                if b[i] == b'"' && b[i + 1..].iter().take(hashes).filter(|&&h| h == b'#').count() == hashes {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
            out.push_str("\"\"");
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A character literal ('x', '\n', '\u{..}', '{') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                // Past the quote, the backslash and the escaped character.
                i += 3;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                out.push_str("' '");
            } else if let Some(n) = src[i + 1..].chars().next().filter(|ch| ch.len_utf8() > 1) {
                // A multi-byte character literal.
                i += 1 + n.len_utf8() + 1;
                out.push_str("' '");
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            let ch = src[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn prev_is_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// `r"`, `r#"`, `br"`, `br#"`...: the bytes up to and past the opening quote, and the hashes.
fn raw_string_start(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    if b.first() == Some(&b'b') {
        i += 1;
    }
    if b.get(i) != Some(&b'r') {
        return None;
    }
    i += 1;
    let mut hashes = 0;
    while b.get(i) == Some(&b'#') {
        hashes += 1;
        i += 1;
    }
    (b.get(i) == Some(&b'"')).then_some((i + 1, hashes))
}

/// The index just past the block that opens at `open` (a `{`).
fn block_end(b: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for (k, &c) in b.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    b.len()
}

/// Removes every item marked `#[cfg(test)]` (a `mod tests { .. }`, a test-only method, a
/// `use`): from the attribute to the end of the item's first block or its `;`.
fn drop_test_items(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let b = rest.as_bytes();
        let mut k = at + "#[cfg(test)]".len();
        let end = loop {
            match b.get(k) {
                None => break b.len(),
                Some(b';') => break k + 1,
                Some(b'{') => break block_end(b, k),
                Some(_) => k += 1,
            }
        };
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Expands a use tree (`a::b::{c, d::{e as f, self}, *}`) into (path, binding) pairs; the
/// binding is `None` for a glob.
fn expand_use(tree: &str) -> Vec<(Vec<String>, Option<String>)> {
    fn go(prefix: &[String], tree: &str, out: &mut Vec<(Vec<String>, Option<String>)>) {
        let tree = tree.trim();
        if tree.is_empty() {
            return;
        }
        if let Some(open) = tree.find('{') {
            let head: Vec<String> =
                tree[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
            let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
            let mut prefix = prefix.to_vec();
            prefix.extend(head);
            let (mut depth, mut start) = (0, 0);
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        go(&prefix, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            go(&prefix, &inner[start..], out);
            return;
        }
        let (path, alias) = match tree.split_once(" as ") {
            Some((p, a)) => (p.trim(), Some(a.trim().to_owned())),
            None => (tree, None),
        };
        let mut full = prefix.to_vec();
        full.extend(path.split("::").map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned));
        let last = full.last().cloned().unwrap_or_default();
        let binding = match last.as_str() {
            "*" => None,
            "self" => alias.or_else(|| full.iter().rev().nth(1).cloned()),
            _ => Some(alias.unwrap_or_else(|| last.clone())),
        };
        out.push((full, binding));
    }
    let mut out = Vec::new();
    let tree = tree.trim().trim_start_matches("::");
    go(&[], tree, &mut out);
    out
}

/// The file of child module `name` declared in `file`, with an optional `#[path]`.
fn child_file(file: &Path, name: &str, path_attr: Option<&str>) -> PathBuf {
    let dir = file.parent().unwrap_or(Path::new("."));
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if let Some(p) = path_attr {
        return dir.join(p);
    }
    let base = if matches!(stem, "lib" | "main" | "mod") { dir.to_path_buf() } else { dir.join(stem) };
    let flat = base.join(format!("{name}.rs"));
    if flat.exists() {
        flat
    } else {
        base.join(name).join("mod.rs")
    }
}

/// Reads the module `path` from `code` (the text of `file`, or of an inline module in it) into
/// `tree`, with its children.
fn read_module(tree: &mut Tree, root: &Path, file: &Path, path: Vec<String>, code: &str) {
    let b = code.as_bytes();
    let mut module = Module { file: rel(root, file), ..Module::default() };
    let mut body = String::new();
    let mut inline: Vec<(String, String)> = Vec::new();
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut k = 0;
    let mut last_path_attr: Option<String> = None;
    while k < b.len() {
        let at_word = !prev_is_ident(b, k);
        let rest = &code[k..];
        if rest.starts_with("#[path") {
            let end = rest.find(']').unwrap_or(rest.len());
            last_path_attr = rest[..end].split('"').nth(1).map(str::to_owned);
            k += end + 1;
            continue;
        }
        if at_word && rest.starts_with("mod ") {
            let after = rest[4..].trim_start();
            let name: String = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let tail = after[name.len()..].trim_start();
            if is_ident(&name) && tail.starts_with(';') {
                module.children.insert(name.clone());
                let f = child_file(file, &name, last_path_attr.take().as_deref());
                files.push((name, f));
                k += rest.find(';').unwrap_or(rest.len()) + 1;
                continue;
            }
            if is_ident(&name) && tail.starts_with('{') {
                let open = k + rest.find('{').unwrap_or(0);
                let end = block_end(b, open);
                module.children.insert(name.clone());
                inline.push((name, code[open + 1..end - 1].to_owned()));
                k = end;
                continue;
            }
        }
        if at_word && rest.starts_with("use ") {
            let end = rest.find(';').unwrap_or(rest.len());
            let text = rest[4..end].trim();
            for (p, binding) in expand_use(text) {
                if let Some(name) = binding {
                    module.bindings.insert(name, p.clone());
                }
                module.refs.push((p, format!("use {text};")));
            }
            k += end + 1;
            continue;
        }
        let ch = rest.chars().next().unwrap_or(' ');
        body.push(ch);
        k += ch.len_utf8();
    }
    // Paths in code: `a::b::c` sequences starting with a keyword or a child module.
    let bb = body.as_bytes();
    let mut k = 0;
    while k < bb.len() {
        if !prev_is_ident(bb, k) && (bb[k].is_ascii_alphabetic() || bb[k] == b'_') {
            let start = k;
            let mut segs: Vec<String> = Vec::new();
            loop {
                let s = k;
                while k < bb.len() && (bb[k].is_ascii_alphanumeric() || bb[k] == b'_') {
                    k += 1;
                }
                segs.push(body[s..k].to_owned());
                if body[k..].starts_with("::") && bb.get(k + 2).is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_') {
                    k += 2;
                } else {
                    break;
                }
            }
            let first = segs[0].as_str();
            if segs.len() > 1 && (matches!(first, "crate" | "super" | "self") || module.children.contains(first)) {
                module.refs.push((segs, body[start..k].to_owned()));
            }
        } else {
            k += 1;
        }
    }
    tree.insert(path.clone(), module);
    for (name, text) in inline {
        let mut p = path.clone();
        p.push(name);
        read_module(tree, root, file, p, &text);
    }
    for (name, f) in files {
        let src = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("reading {}: {e}", f.display()));
        let mut p = path.clone();
        p.push(name);
        read_module(tree, root, &f, p, &drop_test_items(&strip(&src)));
    }
}

fn rel(root: &Path, file: &Path) -> String {
    file.strip_prefix(root).unwrap_or(file).display().to_string()
}

/// The module a path names and the item in it, following re-exports to the defining module.
fn resolve(tree: &Tree, from: &[String], segs: &[String], depth: usize) -> Option<Vec<String>> {
    if depth > 16 || segs.is_empty() {
        return None;
    }
    let mut base: Vec<String>;
    let mut i = 0;
    match segs[0].as_str() {
        "crate" => {
            base = Vec::new();
            i = 1;
        }
        "self" => {
            base = from.to_vec();
            i = 1;
        }
        "super" => {
            base = from.to_vec();
            while segs.get(i).map(String::as_str) == Some("super") {
                base.pop()?;
                i += 1;
            }
        }
        first if tree.get(from).is_some_and(|m| m.children.contains(first)) => base = from.to_vec(),
        first => {
            // A name imported into `from` (`use super::setup; setup::dial(..)`), or another crate.
            let target = tree.get(from)?.bindings.get(first)?;
            let mut p = target.clone();
            p.extend(segs[1..].iter().cloned());
            if p == segs {
                return None;
            }
            return resolve(tree, from, &p, depth + 1);
        }
    }
    while let Some(s) = segs.get(i) {
        if tree.get(&base).is_some_and(|m| m.children.contains(s)) {
            base.push(s.clone());
            i += 1;
        } else {
            break;
        }
    }
    match segs.get(i).map(String::as_str) {
        None | Some("self") | Some("*") => Some(base),
        Some(item) => match tree.get(&base).and_then(|m| m.bindings.get(item)) {
            // Re-exported or imported there: where it comes from (another crate: here).
            Some(p) => resolve(tree, &base, p, depth + 1).or(Some(base)),
            None => Some(base),
        },
    }
}

/// Every arrow between two files of one crate, with the text that draws it.
fn arrows(tree: &Tree) -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for (path, m) in tree {
        for (segs, text) in &m.refs {
            let Some(target) = resolve(tree, path, segs, 0) else { continue };
            let Some(to) = tree.get(&target) else { continue };
            if to.file != m.file {
                out.entry((m.file.clone(), to.file.clone())).or_insert_with(|| text.clone());
            }
        }
    }
    out
}

/// Reads the crate rooted at `root_file`; every `.rs` file it reaches is listed in `seen`.
fn read_crate(repo: &Path, root_file: &Path, seen: &mut BTreeSet<String>) -> Tree {
    let src = std::fs::read_to_string(root_file).unwrap_or_else(|e| panic!("reading {}: {e}", root_file.display()));
    let mut tree = Tree::new();
    read_module(&mut tree, repo, root_file, Vec::new(), &drop_test_items(&strip(&src)));
    seen.extend(tree.values().map(|m| m.file.clone()));
    tree
}

/// The cycles among `arrows`: one shortest cycle per strongly connected group of files, and
/// the group.
fn cycles(arrows: &BTreeMap<(String, String), String>) -> Vec<(Vec<String>, Vec<String>)> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in arrows.keys() {
        next.entry(a).or_default().push(b);
    }
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(n) = todo.pop() {
            for &m in next.get(n.as_str()).into_iter().flatten() {
                if seen.insert(m.to_owned()) {
                    todo.push(m.to_owned());
                }
            }
        }
        seen
    };
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut found = Vec::new();
    for &start in next.keys() {
        if done.contains(start) || !reach(start).contains(start) {
            continue;
        }
        // Shortest way back to `start` (breadth first).
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut visited = BTreeSet::from([start.to_string()]);
        let mut queue = VecDeque::from([start.to_string()]);
        'search: while let Some(n) = queue.pop_front() {
            for &m in next.get(n.as_str()).into_iter().flatten() {
                if m == start {
                    let mut cycle = vec![n.clone()];
                    let mut cur = n.clone();
                    while let Some(p) = prev.get(&cur) {
                        cycle.push(p.clone());
                        cur = p.clone();
                    }
                    cycle.reverse();
                    found.push((cycle, Vec::new()));
                    break 'search;
                }
                if visited.insert(m.to_owned()) {
                    prev.insert(m.to_owned(), n.clone());
                    queue.push_back(m.to_owned());
                }
            }
        }
        // Everything on a cycle with `start` is reported with it.
        let group: Vec<String> = reach(start).into_iter().filter(|n| reach(n.as_str()).contains(start)).collect();
        if let Some(last) = found.last_mut() {
            last.1.clone_from(&group);
        }
        done.extend(group);
    }
    found
}

fn describe(cycle: &[String], arrows: &BTreeMap<(String, String), String>) -> String {
    let mut s = String::new();
    for (k, a) in cycle.iter().enumerate() {
        let b = &cycle[(k + 1) % cycle.len()];
        let why = arrows.get(&(a.clone(), b.clone())).map(String::as_str).unwrap_or("?");
        s.push_str(&format!("\n    {a} -> {b}   ({why})"));
    }
    s
}

/// Every crate root under `dir` (`lib.rs`, `main.rs`, `bin/*.rs`, `bin/*/main.rs`).
fn crate_roots(dir: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"].iter().map(|f| dir.join(f)).filter(|p| p.exists()).collect();
    if let Ok(entries) = std::fs::read_dir(dir.join("bin")) {
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "rs") {
                roots.push(p);
            } else if p.join("main.rs").exists() {
                roots.push(p.join("main.rs"));
            }
        }
    }
    roots.sort();
    roots
}

fn all_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            all_rs(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_module_imports_a_module_that_depends_on_it() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_path_buf();
    let mut report = String::new();
    // Each directory with the fewest arrows its reader must find (fewer: the reader is broken).
    for (dir, least) in [("transports/src", 20), ("worker/src", 20), ("worker/harness/src", 1), ("worker/cli/src", 2)] {
        let dir = repo.join(dir);
        let mut seen = BTreeSet::new();
        let mut edges = 0;
        for root in crate_roots(&dir) {
            let tree = read_crate(&repo, &root, &mut seen);
            let arrows = arrows(&tree);
            edges += arrows.len();
            for (cycle, group) in cycles(&arrows) {
                report.push_str(&format!(
                    "\n  cycle in the crate of {}:{}",
                    rel(&repo, &root),
                    describe(&cycle, &arrows)
                ));
                let inside: Vec<String> = arrows
                    .iter()
                    .filter(|((a, b), _)| group.contains(a) && group.contains(b))
                    .map(|((a, b), why)| format!("\n      {a} -> {b}   ({why})"))
                    .collect();
                report.push_str(&format!("\n    every arrow among its {} files:{}", group.len(), inside.concat()));
            }
        }
        // Every file was read through the module tree (else an arrow could hide in it).
        let mut files = Vec::new();
        all_rs(&dir, &mut files);
        let unread: Vec<String> = files.iter().map(|f| rel(&repo, f)).filter(|f| !seen.contains(f)).collect();
        assert!(unread.is_empty(), "files outside the module tree as read: {unread:?}");
        assert!(edges >= least, "only {edges} arrows found in {}: the reader is broken", dir.display());
    }
    assert!(report.is_empty(), "modules that import a module depending on them:{report}");
}

#[test]
fn the_reader_sees_uses_paths_and_re_exports() {
    assert_eq!(
        expand_use("super::{a::{self, B as C}, d::*}"),
        vec![
            (vec!["super".into(), "a".into(), "self".into()], Some("a".into())),
            (vec!["super".into(), "a".into(), "B".into()], Some("C".into())),
            (vec!["super".into(), "d".into(), "*".into()], None),
        ]
    );
    let code = strip("let s = \"use crate::x;\"; // use crate::y;\nlet c = '{'; /* mod z; */ fn f<'a>() {}");
    assert!(!code.contains("crate::") && !code.contains("mod z") && code.contains("<'a>"), "{code}");
    assert_eq!(drop_test_items("a #[cfg(test)] mod tests { use x::{y}; } b"), "a  b");
    // lib.rs re-exports `Rank` from `wire`; `a` names it through the root: the arrow goes to `wire`.
    let mut tree = Tree::new();
    let module = |file: &str| Module { file: file.into(), ..Module::default() };
    let mut root = module("lib.rs");
    root.children.extend(["a".to_owned(), "wire".to_owned()]);
    root.bindings.insert("Rank".into(), vec!["wire".into(), "Rank".into()]);
    root.refs.push((vec!["wire".into(), "Rank".into()], "pub use wire::Rank;".into()));
    let mut a = module("a.rs");
    a.refs.push((vec!["crate".into(), "Rank".into()], "use crate::Rank;".into()));
    tree.insert(vec![], root);
    tree.insert(vec!["a".into()], a);
    tree.insert(vec!["wire".into()], module("wire.rs"));
    let arrows = arrows(&tree);
    assert_eq!(
        arrows.keys().cloned().collect::<Vec<_>>(),
        vec![("a.rs".to_owned(), "wire.rs".to_owned()), ("lib.rs".to_owned(), "wire.rs".to_owned())]
    );
    assert!(cycles(&arrows).is_empty());
    let mut two = arrows.clone();
    two.insert(("wire.rs".into(), "a.rs".into()), "use crate::a::X;".into());
    let pair = vec!["a.rs".to_owned(), "wire.rs".to_owned()];
    assert_eq!(cycles(&two), vec![(pair.clone(), pair)]);
}
