//! Byte-buffer helpers shared by the formats and the tools.

/// Whether `block` is all zero bytes, tested a machine word at a time.
pub fn is_zero(block: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u64, so viewing the aligned middle as u64s is sound.
    let (head, words, tail) = unsafe { block.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}
