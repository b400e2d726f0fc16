//! Text formats shared by the subcommands, spelled as qemu-img spells them.

use vdisk::formats::SnapshotInfo;

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

/// qemu-img's progress line, redrawn in place ("    (12.34/100%)"), at most once per percent.
pub struct Progress {
    total: u64,
    last: std::sync::atomic::AtomicU64,
}

impl Progress {
    pub fn new(total: u64) -> Self {
        let p = Progress {
            total,
            last: std::sync::atomic::AtomicU64::new(u64::MAX),
        };
        p.show(0);
        p
    }

    pub fn show(&self, done: u64) {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let pct = if self.total == 0 {
            100.0
        } else {
            done as f64 * 100.0 / self.total as f64
        };
        if self.last.swap(pct as u64, Ordering::Relaxed) == pct as u64 && done < self.total {
            return;
        }
        print!("    ({pct:.2}/100%)\r");
        let _ = std::io::stdout().flush();
    }

    pub fn finish(&self) {
        self.show(self.total);
        println!();
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
