//! Option values as QEMU's option parser reads them (util/qemu-option.c, util/cutils.c): sizes
//! (`qemu_strtosz`), numbers (`qemu_strtou64`), booleans (`qapi_bool_parse`), with QEMU's
//! messages, so that every value qemu-img takes means the same to vdisk and every value it
//! refuses is refused with its words. The command line reads its sizes with these too.

/// Why a size was refused; qemu words the two differently.
#[derive(Debug, PartialEq, Eq)]
pub enum SizeError {
    /// Not a size at all (junk, a fraction without a unit, hex with a unit...).
    Invalid,
    /// A size, but negative or not below 2^64.
    Range,
}

/// qemu's `qemu_strtosz`: leading whitespace, a decimal number with an optional fraction and
/// binary suffix (b, k, M, G, T, P, E; a fraction needs one above b), or hex after `0x` with
/// neither. Nothing may follow.
pub fn strtosz(text: &str) -> Result<u64, SizeError> {
    let (number, rest) = split_number(text)?;
    // A number out of range ends qemu's parse before any suffix, which is then junk; and junk
    // outweighs range.
    let number = number.map_err(|e| {
        if rest.is_empty() {
            e
        } else {
            SizeError::Invalid
        }
    })?;
    let (shift, rest) = match rest.chars().next().and_then(suffix_shift) {
        Some(shift) => (shift, &rest[1..]),
        None => (0, rest),
    };
    let (whole, fraction) = (number >> 64, number & u128::from(u64::MAX));
    if !rest.is_empty() || (shift == 0 && fraction != 0) {
        return Err(SizeError::Invalid);
    }
    // The fixed-point product, with the byte rounded half up.
    let part = fraction << shift;
    let bytes = (whole << shift) + (part >> 64) + ((part >> 63) & 1);
    u64::try_from(bytes).map_err(|_| SizeError::Range)
}

/// A number option's value as QEMU's `qemu_strtou64` with base 0 reads it: white space, a
/// sign, then decimal, 0x hexadecimal or 0 octal, nothing after it; a minus sign wraps, as
/// strtoull's does.
pub fn parse_number(text: &str) -> Option<u64> {
    let text = text.trim_start_matches(|c: char| c.is_ascii_whitespace());
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    // from_str_radix would take a second sign.
    if text.starts_with(['+', '-']) {
        return None;
    }
    let n = if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()
    } else if text.len() > 1 && text.starts_with('0') {
        u64::from_str_radix(&text[1..], 8).ok()
    } else {
        text.parse().ok()
    }?;
    Some(if negative { n.wrapping_neg() } else { n })
}

/// qemu's `parse_option_number`: the value of a number option (`-o key=value`), or its
/// message, which tells digits too many for 64 bits from what is no number.
pub fn option_number(key: &str, value: &str) -> Result<u64, String> {
    parse_number(value).ok_or_else(|| {
        let digits = value.trim_start_matches(|c: char| c.is_ascii_whitespace());
        let digits = digits.strip_prefix(['-', '+']).unwrap_or(digits);
        let (digits, radix) = match digits.strip_prefix("0x").or(digits.strip_prefix("0X")) {
            Some(hex) => (hex, 16),
            None if digits.starts_with('0') => (digits, 8),
            None => (digits, 10),
        };
        match !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix)) {
            true => format!("Value '{value}' is too large for parameter '{key}'"),
            false => format!("Parameter '{key}' expects a number"),
        }
    })
}

/// qemu's `parse_option_size`: the value of a size option (`-o key=value`), or its message.
pub fn option_size(key: &str, value: &str) -> Result<u64, String> {
    strtosz(value).map_err(|e| match e {
        SizeError::Range => format!("Value '{value}' is out of range for parameter '{key}'"),
        SizeError::Invalid => format!(
            "Parameter '{key}' expects a non-negative number below 2^64\nOptional suffix k, M, \
             G, T, P or E means kilo-, mega-, giga-, tera-, peta-\nand exabytes, respectively."
        ),
    })
}

/// A boolean option's value as QEMU's option parser reads it (`qapi_bool_parse`).
pub fn parse_bool(key: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" | "yes" | "true" | "y" => Ok(true),
        "off" | "no" | "false" | "n" => Ok(false),
        _ => Err(format!("Parameter '{key}' expects 'on' or 'off'")),
    }
}

/// Numbers are 64.64 fixed point, as in qemu: integer part above, fraction below.
type Fixed = u128;

/// Splits the number (or the range error that ends qemu's parse of it) from the text after it.
fn split_number(text: &str) -> Result<(Result<Fixed, SizeError>, &str), SizeError> {
    let body = text.trim_start_matches(is_c_space);
    let (minus, unsigned) = match body.as_bytes().first() {
        Some(b'+') => (false, &body[1..]),
        Some(b'-') => (true, &body[1..]),
        _ => (false, body),
    };
    let (int, after) = unsigned.split_at(count(unsigned, |c| c.is_ascii_digit()));
    if int.is_empty() {
        // Only a fraction such as ".5k" does without integer digits; qemu checks its sign
        // bit, so even "-.0" is out of range.
        let (fraction, rest) = fraction(unsigned).ok_or(SizeError::Invalid)?;
        let number = if minus {
            Err(SizeError::Range)
        } else {
            Ok(fraction)
        };
        return Ok((number, rest));
    }
    let Some(whole) = int.parse::<u64>().ok().filter(|_| !minus) else {
        return Ok((Err(SizeError::Range), after));
    };
    if int == "0" && after.starts_with(['x', 'X']) {
        return hex(&after[1..]);
    }
    let whole = Fixed::from(whole) << 64;
    Ok(match fraction(after) {
        Some((fraction, rest)) => (whole.checked_add(fraction).ok_or(SizeError::Range), rest),
        // "5." and "5.k": a point with no digits after it.
        None => (Ok(whole), after.strip_prefix('.').unwrap_or(after)),
    })
}

/// Hex digits after `0x`, which neither a fraction nor a suffix may follow.
fn hex(text: &str) -> Result<(Result<Fixed, SizeError>, &str), SizeError> {
    let (digits, rest) = text.split_at(count(text, |c| c.is_ascii_hexdigit()));
    let suffixed = rest.starts_with('.') || rest.chars().next().and_then(suffix_shift).is_some();
    if digits.is_empty() || suffixed {
        return Err(SizeError::Invalid);
    }
    let value = u64::from_str_radix(digits, 16).map_err(|_| SizeError::Range);
    Ok((value.map(|v| Fixed::from(v) << 64), rest))
}

/// A point and at least one digit, as strtod reads them (qemu cuts the text at any `e` first,
/// so there is never an exponent), in 1/2^64 units, and the text after them.
fn fraction(text: &str) -> Option<(Fixed, &str)> {
    let after_point = text.strip_prefix('.')?;
    let (digits, rest) = after_point.split_at(count(after_point, |c| c.is_ascii_digit()));
    if digits.is_empty() {
        return None;
    }
    let value: f64 = format!("0.{digits}").parse().ok()?;
    // Exact, since it scales by a power of two; `as` truncates like qemu's cast. A fraction
    // that rounds to 1.0 carries into the integer part.
    let units = (value * 2f64.powi(64)) as Fixed;
    // qemu keeps any fraction that is not zero, however small, as 1/2^64 at least.
    let nonzero = digits.bytes().any(|b| b != b'0');
    Some((if nonzero { units.max(1) } else { units }, rest))
}

/// How many characters at the start of `text` are `wanted` (all ASCII).
fn count(text: &str, wanted: impl Fn(char) -> bool) -> usize {
    text.len() - text.trim_start_matches(wanted).len()
}

/// The shift of a binary suffix, by qemu's `suffix_mul`.
fn suffix_shift(c: char) -> Option<u32> {
    Some(match c.to_ascii_uppercase() {
        'B' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        'T' => 40,
        'P' => 50,
        'E' => 60,
        _ => return None,
    })
}

/// C's `isspace` in the C locale, which strtoull skips.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

#[cfg(test)]
mod tests {
    use super::{strtosz, SizeError::*};

    #[test]
    fn sizes_parse_like_qemu() {
        let cases = [
            ("1000", Ok(1000)),
            ("64k", Ok(65536)),
            ("1.5G", Ok(3 << 29)),
            ("2M", Ok(2 << 20)),
            (" \t1M", Ok(1 << 20)),
            ("+1", Ok(1)),
            ("08", Ok(8)),
            ("5.", Ok(5)),
            ("5.k", Ok(5 << 10)),
            ("1.0", Ok(1)),
            (".5k", Ok(512)),
            ("+.5k", Ok(512)),
            ("0x100000", Ok(1 << 20)),
            ("0X1b", Ok(27)),
            ("0.99999999999999999999k", Ok(1024)),
            ("1.0000000000000001E", Ok((1 << 60) + 115)),
            ("18446744073709551615", Ok(u64::MAX)),
            ("1x", Err(Invalid)),
            ("1.1", Err(Invalid)),
            ("0.5", Err(Invalid)),
            ("1.5b", Err(Invalid)),
            ("1M ", Err(Invalid)),
            ("1e3", Err(Invalid)),
            ("0x10k", Err(Invalid)),
            ("0x1.8M", Err(Invalid)),
            ("0x", Err(Invalid)),
            (".", Err(Invalid)),
            (".k", Err(Invalid)),
            ("inf", Err(Invalid)),
            ("-.5k", Err(Invalid)),
            ("-1x", Err(Invalid)),
            ("", Err(Invalid)),
            ("-1", Err(Range)),
            ("-0", Err(Range)),
            ("-.5", Err(Range)),
            ("16E", Err(Range)),
            ("18446744073709551616", Err(Range)),
            ("0xffffffffffffffffff", Err(Range)),
            (
                "15.9999999999999999999999999999999999999999999999999999E",
                Err(Range),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(strtosz(text), want, "{text:?}");
        }
    }
}
