//! qemu-img bench's request schedule, from its options, checked as qemu-img checks them.

use super::Args;
use crate::size::parse_size;

const INT_MAX: u64 = i32::MAX as u64;

/// qemu's `cvtnum_full`: a size with an optional suffix, within `[min, max]`.
fn number(what: &str, text: &str, min: u64, max: u64) -> Result<u64, String> {
    let v = parse_size(text).ok_or_else(|| format!("Invalid {what} specified: '{text}'."))?;
    if v < min || v > max {
        return Err(format!(
            "Invalid {what} specified. Must be between {min} and {max}."
        ));
    }
    Ok(v)
}

/// What one run does.
pub struct Plan {
    pub count: u64,
    pub depth: u64,
    pub offset: u64,
    pub bufsize: u64,
    pub step: u64,
    pub write: bool,
    pub pattern: u8,
    pub flush_interval: u64,
    pub drain: bool,
}

pub fn plan(a: &Args) -> Result<Plan, String> {
    let plan = Plan {
        count: number("request count", &a.count, 1, INT_MAX)?,
        depth: number("queue depth", &a.depth, 1, INT_MAX)?,
        offset: number("offset", &a.offset, 0, i64::MAX as u64)?,
        bufsize: number("buffer size", &a.buffer_size, 1, INT_MAX)?,
        step: number("step_size", &a.step_size, 0, INT_MAX)?,
        write: a.write,
        pattern: number("pattern byte", &a.pattern, 0, 255)? as u8,
        flush_interval: number("flush interval", &a.flush_interval, 0, INT_MAX)?,
        drain: !a.no_drain,
    };
    if plan.flush_interval > 0 && !plan.write {
        return Err("--flush-interval is only available in write tests".into());
    }
    if plan.flush_interval > 0 && plan.flush_interval < plan.depth {
        return Err("Flush interval can't be smaller than depth".into());
    }
    Ok(Plan {
        step: if plan.step == 0 {
            plan.bufsize
        } else {
            plan.step
        },
        ..plan
    })
}
