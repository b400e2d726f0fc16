//! Sizes on the command line, read by qemu's rules (`qemu_strtosz` in util/cutils.c) so that
//! every size qemu-img takes means the same bytes to vdisk, and every size it refuses is refused
//! with its message.

pub use vdisk::spec::{option_number, option_size, strtosz, SizeError};

/// [`strtosz`] for callers with their own message for a refused size.
pub fn parse_size(text: &str) -> Option<u64> {
    strtosz(text).ok()
}

/// qemu-img's `cvtnum`: a size argument (`what`: "image size", "start offset"...) that must fit
/// an `int64_t`, or the message qemu-img prints for it.
pub fn cvtnum(what: &str, text: &str) -> Result<u64, String> {
    cvtnum_in(what, text, 0, i64::MAX as u64)
}

/// qemu-img's `cvtnum_full`: as [`cvtnum`], within `[min, max]`.
pub fn cvtnum_in(what: &str, text: &str, min: u64, max: u64) -> Result<u64, String> {
    match strtosz(text) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        Err(SizeError::Invalid) => Err(format!("Invalid {what} specified: '{text}'.")),
        _ => Err(format!(
            "Invalid {what} specified. Must be between {min} and {max}."
        )),
    }
}
