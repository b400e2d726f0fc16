//! Refcount blocks: arrays of 2^refcount_order-bit counters, one per host cluster.
//!
//! Widths below 8 bits are packed least significant bit first within each byte, as QEMU's
//! `get_refcount_ro0..2` read them; widths of 8 bits and more are big-endian integers.

/// For widths below 8 bits: the byte holding entry `i`, the entry's shift and its mask.
fn packed(i: usize, order: u32) -> (usize, u32, u8) {
    let bits = 1usize << order;
    let per_byte = 8 / bits;
    (
        i / per_byte,
        ((i % per_byte) * bits) as u32,
        ((1u16 << bits) - 1) as u8,
    )
}

/// Reads entry `index` of a refcount block.
pub fn get(block: &[u8], index: u64, order: u32) -> u64 {
    let i = index as usize;
    match order {
        0..=2 => {
            let (byte, shift, mask) = packed(i, order);
            u64::from((block[byte] >> shift) & mask)
        }
        3 => u64::from(block[i]),
        4 => u64::from(u16::from_be_bytes([block[2 * i], block[2 * i + 1]])),
        5 => u64::from(u32::from_be_bytes(
            block[4 * i..4 * i + 4].try_into().expect("4 bytes"),
        )),
        _ => u64::from_be_bytes(block[8 * i..8 * i + 8].try_into().expect("8 bytes")),
    }
}

/// Writes entry `index` of a refcount block. `value` must fit the width.
pub fn set(block: &mut [u8], index: u64, order: u32, value: u64) {
    let i = index as usize;
    match order {
        0..=2 => {
            let (byte, shift, mask) = packed(i, order);
            let b = &mut block[byte];
            *b = (*b & !(mask << shift)) | (((value as u8) & mask) << shift);
        }
        3 => block[i] = value as u8,
        4 => block[2 * i..2 * i + 2].copy_from_slice(&(value as u16).to_be_bytes()),
        5 => block[4 * i..4 * i + 4].copy_from_slice(&(value as u32).to_be_bytes()),
        _ => block[8 * i..8 * i + 8].copy_from_slice(&value.to_be_bytes()),
    }
}

/// The largest refcount a width can hold.
pub fn max_value(order: u32) -> u64 {
    if order >= 6 {
        u64::MAX
    } else {
        (1u64 << (1 << order)) - 1
    }
}

/// Number of entries in one refcount block of `cluster_bits`.
pub fn entries_per_block(cluster_bits: u32, order: u32) -> u64 {
    (1u64 << (cluster_bits + 3)) >> order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_round_trips_without_touching_neighbours() {
        for order in 0..=6 {
            let mut block = vec![0u8; 64];
            let n = entries_per_block(9, order).min((64 * 8) >> order);
            let max = max_value(order);
            for i in 0..n {
                set(&mut block, i, order, (i * 7 + 3) & max);
            }
            for i in 0..n {
                assert_eq!(
                    get(&block, i, order),
                    (i * 7 + 3) & max,
                    "order {order} index {i}"
                );
            }
        }
    }

    #[test]
    fn one_bit_refcounts_are_lsb_first() {
        let mut block = vec![0u8; 1];
        set(&mut block, 0, 0, 1);
        assert_eq!(block[0], 0b0000_0001);
        set(&mut block, 7, 0, 1);
        assert_eq!(block[0], 0b1000_0001);
    }
}
