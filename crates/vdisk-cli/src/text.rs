//! Text formats shared by the subcommands, spelled as qemu-img spells them.

use vdisk::formats::SnapshotInfo;
use vdisk::sync::lock;

/// C's `printf("%0.3g", v)` for the non-negative values sizes produce.
fn g3(v: f64) -> String {
    let sci = format!("{v:.2e}");
    let exp: i32 = sci
        .split('e')
        .nth(1)
        .and_then(|e| e.parse().ok())
        .unwrap_or(0);
    let strip = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if !(-4..3).contains(&exp) {
        let (mantissa, _) = sci.split_once('e').unwrap_or((&sci, ""));
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{}e{sign}{:02}", strip(mantissa.to_string()), exp.abs());
    }
    strip(format!("{:.*}", (2 - exp) as usize, v))
}

/// QEMU's `size_to_str`: "332 KiB", "2 MiB", "0 B".
pub fn size_to_str(val: u64) -> String {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    // frexp's exponent of val / (1000 / 1024): a value of 1000 units or more moves to the next
    // unit, so the number printed stays below 1000.
    let scaled = val as f64 / (1000.0 / 1024.0);
    let exp = if scaled == 0.0 {
        0
    } else {
        scaled.log2().floor() as i64 + 1
    };
    let i = ((exp - 1) / 10).clamp(0, 6) as usize;
    let div = (1u64 << (i * 10)) as f64;
    format!("{} {}B", g3(val as f64 / div), SUFFIXES[i])
}

/// C's `printf("%#-16lx", v)`: "0x1f" (or "0" for zero) left-justified in 16 columns.
pub fn hex16(v: u64) -> String {
    let s = if v == 0 {
        "0".to_string()
    } else {
        format!("{v:#x}")
    };
    format!("{s:<16}")
}

/// Local time as `strftime("%Y-%m-%d %H:%M:%S")`.
pub fn local_date(secs: u32) -> String {
    let t = libc::time_t::from(secs);
    // SAFETY: an all-zero `tm` is a valid value for localtime_r to overwrite.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers refer to live locals for the duration of the call.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return String::from("1970-01-01 00:00:00");
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// qemu-img's progress line, redrawn in place ("    (12.34/100%)\r"), as QEMU's
/// qemu-progress.c draws it: in single precision, and only when it moved more than `min_skip`
/// points since it was last drawn, or reached 0 or 100.
pub struct Progress {
    /// What `show` counts to (the commands that count bytes).
    total: u64,
    min_skip: f32,
    /// The current value and the one last drawn.
    state: std::sync::Mutex<(f32, f32)>,
}

impl Progress {
    /// Starts the line at 0 (qemu_progress_init, then qemu_progress_print(0, 100)), moving at
    /// least a point at a time, as most of qemu-img's commands have it.
    pub fn new(total: u64) -> Self {
        let p = Progress {
            total,
            min_skip: 1.0,
            state: std::sync::Mutex::new((0.0, 0.0)),
        };
        p.print(0.0, 100.0);
        p
    }

    /// qemu_progress_print: with `max` 0, `delta` is the new value; else the value moves by
    /// `delta` percent of `max`.
    pub fn print(&self, delta: f32, max: f32) {
        use std::io::Write;
        let mut state = lock(&self.state);
        let (current, last) = &mut *state;
        let next = if max == 0.0 {
            delta
        } else {
            *current + delta / 100.0 * max
        };
        *current = next.min(100.0);
        let moved = *current > *last + self.min_skip || *current < *last - self.min_skip;
        if moved || *current == 100.0 || *current == 0.0 {
            *last = *current;
            print!("    ({:.2}/100%)\r", f64::from(*current));
            let _ = std::io::stdout().flush();
        }
    }

    /// Draws `done` of the total given to [`Progress::new`].
    pub fn show(&self, done: u64) {
        let pct = match self.total {
            0 => 100.0,
            total => 100.0 * done as f64 / total as f64,
        };
        self.print(pct as f32, 0.0);
    }

    /// Ends the line, as qemu_progress_end does also after a failure.
    pub fn end(&self) {
        println!();
    }

    /// Draws 100 and ends the line.
    pub fn finish(&self) {
        self.print(100.0, 0.0);
        self.end();
    }
}

/// The "Snapshot list:" table of `qemu-img info` and `qemu-img snapshot -l` (empty without
/// snapshots).
pub fn snapshot_list(snapshots: &[SnapshotInfo]) -> String {
    if snapshots.is_empty() {
        return String::new();
    }
    let mut s = String::from("Snapshot list:\n");
    s += &format!(
        "{:<7} {:<16} {:>8} {:>19} {:>15} {:>10}\n",
        "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"
    );
    for sn in snapshots {
        let secs = sn.vm_clock_nsec / 1_000_000_000;
        let clock = format!(
            "{:04}:{:02}:{:02}.{:03}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60,
            (sn.vm_clock_nsec / 1_000_000) % 1000
        );
        let icount = sn
            .icount
            .map_or_else(|| "--".to_string(), |i| i.to_string());
        // QEMU pads with printf, which counts bytes, not characters.
        let pad = |text: &str, width: usize| {
            let fill = width.saturating_sub(text.len());
            format!("{text}{}", " ".repeat(fill))
        };
        s += &format!(
            "{} {} {:>8} {:>19} {:>15} {:>10}\n",
            pad(&sn.id, 7),
            pad(&sn.name, 16),
            size_to_str(sn.vm_state_size),
            local_date(sn.date_sec),
            clock,
            icount
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_like_qemu() {
        assert_eq!(size_to_str(0), "0 B");
        assert_eq!(size_to_str(339968), "332 KiB");
        assert_eq!(size_to_str(2 << 20), "2 MiB");
        assert_eq!(size_to_str(197120), "192 KiB");
        assert_eq!(size_to_str(999), "999 B");
        assert_eq!(size_to_str(1023), "0.999 KiB");
        assert_eq!(size_to_str(1536 << 20), "1.5 GiB");
    }

    #[test]
    fn hex_columns_print_like_printf() {
        assert_eq!(hex16(0), "0               ");
        assert_eq!(hex16(0x10000), "0x10000         ");
    }
}
