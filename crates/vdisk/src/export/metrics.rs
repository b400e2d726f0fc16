//! Counters in Prometheus' text format (version 0.0.4), as the `--stats` endpoint serves them:
//! the NBD server's (`nbd/metrics.rs`), and those of other exports beside it.

use std::fmt::Write as _;
use std::sync::Arc;

use crate::counters::{FormatStat, StatValue};

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

    /// Formats' own counters ([`crate::Driver::format_stats`]) of each `(export, stats)`:
    /// a family per name, in the order the first export that has it gives them.
    pub fn format_stats(&mut self, exports: &[(&str, Vec<FormatStat>)]) {
        let mut names: Vec<&FormatStat> = Vec::new();
        for stat in exports.iter().flat_map(|(_, s)| s) {
            if !names.iter().any(|n| n.name == stat.name) {
                names.push(stat);
            }
        }
        for first in names {
            let name = format!("vdisk_{}", first.name);
            self.head(&name, first.value.kind(), first.help);
            for (export, stats) in exports {
                let Some(s) = stats.iter().find(|s| s.name == first.name) else {
                    continue;
                };
                let label = escape(export);
                let _ = match s.value {
                    StatValue::Ratio(r) => writeln!(self.out, "{name}{{export=\"{label}\"}} {r}"),
                    v => writeln!(self.out, "{name}{{export=\"{label}\"}} {v}"),
                };
            }
        }
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
    fn format_stats_are_families() {
        let stat = |name, value| FormatStat {
            name,
            help: "h",
            value,
        };
        let a = vec![
            stat("seqlog_cleaned_segments_total", StatValue::Counter(3)),
            stat("seqlog_write_amplification", StatValue::Ratio(1.5)),
        ];
        let b = vec![stat("seqlog_write_amplification", StatValue::Ratio(2.25))];
        let mut out = String::new();
        Writer { out: &mut out }.format_stats(&[("a", a), ("b", b), ("raw", Vec::new())]);
        assert_eq!(
            out,
            "# HELP vdisk_seqlog_cleaned_segments_total h\n\
             # TYPE vdisk_seqlog_cleaned_segments_total counter\n\
             vdisk_seqlog_cleaned_segments_total{export=\"a\"} 3\n\
             # HELP vdisk_seqlog_write_amplification h\n\
             # TYPE vdisk_seqlog_write_amplification gauge\n\
             vdisk_seqlog_write_amplification{export=\"a\"} 1.5\n\
             vdisk_seqlog_write_amplification{export=\"b\"} 2.25\n"
        );
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
