//! Counters in Prometheus' text format (version 0.0.4), as the `--stats` endpoint serves them:
//! the NBD server's (`nbd/metrics.rs`), and those of other exports beside it.

use std::fmt::Write as _;
use std::sync::Arc;

/// Renders more families into a metrics page (an export other than NBD's).
pub type MetricsSource = Arc<dyn Fn(&mut String) + Send + Sync>;

pub(crate) struct Writer<'a> {
    pub out: &'a mut String,
}

impl Writer<'_> {
    pub fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        let _ = write!(self.out, "{name}");
        if !labels.is_empty() {
            let body: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = write!(self.out, "{{{}}}", body.join(","));
        }
        let _ = writeln!(self.out, " {value}");
    }
}

/// Label values escape backslash, double quote and newline.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
