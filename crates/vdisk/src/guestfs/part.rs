//! Where a file system may start: the whole disk, or its first partition in an MBR or GPT
//! table (512-byte sectors, as a guest's firmware reads them).

use super::ReadFn;

const SECTOR: u64 = 512;

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from(u32_at(b, at)) | u64::from(u32_at(b, at + 4)) << 32
}

/// `[start, end)` byte ranges a file system may take: the whole disk, then the first partition.
pub(super) fn candidates(size: u64, read: ReadFn) -> Vec<(u64, u64)> {
    let mut out = vec![(0, size)];
    if let Some(p) = first_partition(size, read) {
        out.push(p);
    }
    out
}

/// The sector of the GPT entries, whose rewrite moves the first partition.
pub(super) fn watch(size: u64, read: ReadFn) -> Vec<(u64, u64)> {
    match gpt_header(size, read) {
        Some((entries, _, _)) => vec![(entries, entries + SECTOR)],
        None => Vec::new(),
    }
}

fn sane(start: u64, end: u64, size: u64) -> Option<(u64, u64)> {
    (start > 0 && start < end && end <= size).then_some((start, end))
}

fn first_partition(size: u64, read: ReadFn) -> Option<(u64, u64)> {
    let mut mbr = [0u8; 512];
    if size < 2 * SECTOR || !read(0, &mut mbr) || mbr[510..512] != [0x55, 0xaa] {
        return None;
    }
    let entries: Vec<&[u8]> = mbr[446..510].chunks(16).collect();
    if entries.iter().any(|e| e[4] == 0xee) {
        return gpt_first(size, read);
    }
    // The first used entry; extended partitions (0x05, 0x0f, 0x85) hold no file system.
    let e = entries
        .iter()
        .find(|e| e[4] != 0 && ![0x05, 0x0f, 0x85].contains(&e[4]))?;
    let start = u64::from(u32_at(e, 8)) * SECTOR;
    let len = u64::from(u32_at(e, 12)) * SECTOR;
    sane(start, start.checked_add(len)?, size)
}

/// The GPT header at LBA 1: where its entries are, how many, and their size.
fn gpt_header(size: u64, read: ReadFn) -> Option<(u64, u32, u32)> {
    let mut h = [0u8; 512];
    if size < 3 * SECTOR || !read(SECTOR, &mut h) || &h[0..8] != b"EFI PART" {
        return None;
    }
    let entries = u64_at(&h, 72).checked_mul(SECTOR)?;
    let (count, entry_size) = (u32_at(&h, 80), u32_at(&h, 84));
    if entries >= size || !(128..=4096).contains(&entry_size) || count == 0 {
        return None;
    }
    Some((entries, count, entry_size))
}

fn gpt_first(size: u64, read: ReadFn) -> Option<(u64, u64)> {
    let (entries, count, entry_size) = gpt_header(size, read)?;
    let mut e = vec![0u8; entry_size as usize];
    // The first entry in use (a type GUID not all zero); a table rarely starts with gaps, so a
    // few entries are enough.
    for i in 0..u64::from(count.min(16)) {
        let at = entries.checked_add(i * u64::from(entry_size))?;
        if !read(at, &mut e) {
            return None;
        }
        if e[0..16].iter().any(|&b| b != 0) {
            let start = u64_at(&e, 32).checked_mul(SECTOR)?;
            let end = u64_at(&e, 40).checked_add(1)?.checked_mul(SECTOR)?;
            return sane(start, end, size);
        }
    }
    None
}
