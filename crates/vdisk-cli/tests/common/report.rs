//! Discrepancies between the two tools, collected into one readable report.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use super::{Outcome, Workdir};

/// A line diff that prints the differing middle of two texts, after their common head and tail.
pub fn line_diff(qemu: &str, vdisk: &str) -> String {
    let a: Vec<&str> = qemu.split_inclusive('\n').collect();
    let b: Vec<&str> = vdisk.split_inclusive('\n').collect();
    let head = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let tail = a[head..]
        .iter()
        .rev()
        .zip(b[head..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    const MAX: usize = 25;
    let mut s = format!("first difference at line {}\n", head + 1);
    for (tag, lines) in [
        ("qemu ", &a[head..a.len() - tail]),
        ("vdisk", &b[head..b.len() - tail]),
    ] {
        for l in lines.iter().take(MAX) {
            let _ = writeln!(s, "      {tag}| {l:?}");
        }
        if lines.len() > MAX {
            let _ = writeln!(s, "      {tag}| ... {} more lines", lines.len() - MAX);
        }
        if lines.is_empty() {
            let _ = writeln!(s, "      {tag}| (nothing)");
        }
    }
    s
}

/// Discrepancies collected over a family of images, reported together at the end.
pub struct Failures {
    family: String,
    workdir: PathBuf,
    items: Vec<String>,
    checks: usize,
}

impl Failures {
    pub fn new(family: &str, wd: &Workdir) -> Failures {
        Failures {
            family: family.to_string(),
            workdir: wd.path().to_path_buf(),
            items: Vec::new(),
            checks: 0,
        }
    }

    pub fn add(&mut self, image: &str, what: &str, detail: impl AsRef<str>) {
        self.items.push(format!(
            "[{image}] {what}:\n    {}",
            detail.as_ref().trim_end()
        ));
    }

    /// Counts one comparison; returns `ok` so callers can chain.
    pub fn count(&mut self, ok: bool) -> bool {
        self.checks += 1;
        ok
    }

    pub fn same_text(&mut self, image: &str, what: &str, qemu: &str, vdisk: &str) -> bool {
        if self.count(qemu == vdisk) {
            return true;
        }
        self.add(image, what, line_diff(qemu, vdisk));
        false
    }

    /// Same stdout, same stderr lines (modulo the program prefix), same exit status.
    pub fn same_outcome(&mut self, image: &str, what: &str, q: &Outcome, v: &Outcome) -> bool {
        let mut diffs = Vec::new();
        if q.code != v.code {
            diffs.push(format!(
                "exit status: qemu {:?}, vdisk {:?}",
                q.code, v.code
            ));
        }
        if q.stdout != v.stdout {
            diffs.push(format!(
                "stdout differs, {}",
                line_diff(&q.stdout, &v.stdout)
            ));
        }
        let (qe, ve) = (
            q.stderr_lines_as_vdisk(),
            v.stderr.lines().map(String::from),
        );
        let ve: Vec<String> = ve.collect();
        if qe != ve {
            diffs.push(format!(
                "stderr differs (qemu's prefix mapped to \"vdisk: \"), {}",
                line_diff(&lines(&qe), &lines(&ve))
            ));
        }
        if self.count(diffs.is_empty()) {
            return true;
        }
        self.add(
            image,
            what,
            format!(
                "$ {}\n    $ {}\n    {}",
                q.command,
                v.command,
                diffs.join("\n    ")
            ),
        );
        false
    }

    /// Panics with every discrepancy if there was any.
    pub fn finish(self) {
        let _ = writeln!(
            std::io::stderr(),
            "{}: {} comparisons, {} discrepancies",
            self.family,
            self.checks,
            self.items.len()
        );
        if self.items.is_empty() {
            return;
        }
        panic!(
            "{} discrepancies between vdisk and QEMU in family '{}' (commands ran in {}; set \
             QEMU_COMPAT_KEEP=1 to keep it):\n\n{}\n",
            self.items.len(),
            self.family,
            self.workdir.display(),
            self.items.join("\n\n")
        );
    }
}

fn lines(v: &[String]) -> String {
    v.iter().map(|l| format!("{l}\n")).collect()
}
