//! The local file of a write buffer: a header block, two copies of the slot table, then the
//! slots, each the size of one object.
//!
//! ```text
//!   0             header: magic "VDWBUF01", version (2; 1 read too), object size, slots,
//!                 the disk's name (pool/prefix), crc32c of the block's first 4092 bytes
//!   4096          table copy 0 ─┐ magic "VDWBTAB1", generation, crc32c, reserved,
//!   4096 + T      table copy 1 ─┘ (version 2:) place (u64: the cluster and pool), reserved,
//!                                 then per slot: object index (u64), flags (u32: 1 = holds
//!                                 data RADOS lacks, 2 = a clean copy of the object), (version
//!                                 2:) reserved (u32), the object's RADOS version (u64)
//!   4096 + 2T     slot 0, slot 1, ... (object size each)
//! ```
//!
//! Tables are written alternately, each followed by a sync: an open takes the copy with the
//! highest generation whose checksum matches, so a torn table write leaves the one before it.
//! A slot is listed only once what it holds (the object's bytes read back from RADOS when it
//! was taken, and writes since) was synced, and is unlisted, durably, before its object is
//! removed or the slot given to another object (`mod.rs`). Clean copies are named only by the
//! table a close writes (after a sync of the slots), and a writable open writes a table
//! without them before it serves anything (`keep.rs`).
//!
//! A version 1 buffer (made by an older vdisk) has entries of 12 bytes and no clean copies.

use crate::checksum::crc32c;

const MAGIC: &[u8; 8] = b"VDWBUF01";
const TABLE_MAGIC: &[u8; 8] = b"VDWBTAB1";
/// The version of the buffers vdisk makes; it reads version 1 too.
pub const VERSION: u32 = 2;
pub const BLOCK: u64 = 4096;
/// Flags of a table entry.
const LISTED: u32 = 1;
const CLEAN: u32 = 2;
/// The most slots a buffer has (a table of at most 48 KiB).
pub const MAX_SLOTS: u32 = 4096;
/// The longest disk name the header keeps.
const MAX_NAME: usize = 1024;

/// Where things are in the local file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub object_size: u64,
    pub slots: u32,
    /// The header's version: what a table entry holds.
    pub version: u32,
}

/// What a table says: its generation, where its objects are (`Objects::place`, 0 in a
/// version 1 table), the slots holding data RADOS lacks (slot, object), and the clean copies
/// (slot, object, the object's version).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub generation: u64,
    pub place: u64,
    pub held: Vec<(usize, u64)>,
    pub clean: Vec<(usize, u64, u64)>,
}

impl Layout {
    /// Table header bytes before the entries.
    fn head(&self) -> usize {
        if self.version == 1 {
            24
        } else {
            40
        }
    }

    fn entry(&self) -> usize {
        if self.version == 1 {
            12
        } else {
            24
        }
    }

    pub fn table_len(&self) -> u64 {
        (self.head() + self.entry() * self.slots as usize).next_multiple_of(BLOCK as usize) as u64
    }

    pub fn table_at(&self, copy: u64) -> u64 {
        BLOCK + (copy % 2) * self.table_len()
    }

    /// Where slot `s` starts.
    pub fn slot_at(&self, s: usize) -> u64 {
        BLOCK + 2 * self.table_len() + s as u64 * self.object_size
    }

    /// The header block naming the disk `name`.
    pub fn encode_header(&self, name: &str) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK as usize];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.object_size.to_le_bytes());
        b[24..28].copy_from_slice(&self.slots.to_le_bytes());
        let name = &name.as_bytes()[..name.len().min(MAX_NAME)];
        b[28..32].copy_from_slice(&(name.len() as u32).to_le_bytes());
        b[32..32 + name.len()].copy_from_slice(name);
        let crc = crc32c(0, &b[..4092]);
        b[4092..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The layout a header block holds, and the disk it names; or what is wrong with it.
    pub fn decode_header(b: &[u8]) -> Result<(Layout, String), String> {
        if b.len() < BLOCK as usize || &b[..8] != MAGIC {
            return Err("not a vdisk write buffer".into());
        }
        if u32_at(b, 4092) != crc32c(0, &b[..4092]) {
            return Err("its header's checksum does not match".into());
        }
        let version = u32_at(b, 8);
        if !(1..=VERSION).contains(&version) {
            return Err(format!("version {version} (vdisk knows 1 to {VERSION})"));
        }
        let layout = Layout {
            object_size: u64_at(b, 16),
            slots: u32_at(b, 24),
            version,
        };
        let ok_size =
            (512..=64 << 20).contains(&layout.object_size) && layout.object_size % 512 == 0;
        if !ok_size || !(1..=MAX_SLOTS).contains(&layout.slots) {
            return Err(format!(
                "object size {} or slot count {} out of range",
                layout.object_size, layout.slots
            ));
        }
        let n = u32_at(b, 28) as usize;
        if n > MAX_NAME {
            return Err(format!("disk name of {n} bytes"));
        }
        Ok((layout, String::from_utf8_lossy(&b[32..32 + n]).into_owned()))
    }

    /// A table of `t.generation` listing `t.held` and, in a version 2 table, `t.clean`.
    pub fn encode_table(&self, t: &Table) -> Vec<u8> {
        let mut b = vec![0u8; self.table_len() as usize];
        b[..8].copy_from_slice(TABLE_MAGIC);
        b[8..16].copy_from_slice(&t.generation.to_le_bytes());
        let (head, entry) = (self.head(), self.entry());
        let mut put = |s: usize, object: u64, flags: u32, version: u64| {
            let at = head + entry * s;
            b[at..at + 8].copy_from_slice(&object.to_le_bytes());
            b[at + 8..at + 12].copy_from_slice(&flags.to_le_bytes());
            if entry > 12 {
                b[at + 16..at + 24].copy_from_slice(&version.to_le_bytes());
            }
        };
        for &(s, object) in &t.held {
            put(s, object, LISTED, 0);
        }
        if self.version > 1 {
            for &(s, object, version) in &t.clean {
                put(s, object, CLEAN, version);
            }
            b[24..32].copy_from_slice(&t.place.to_le_bytes());
        }
        let crc = table_crc(&b);
        b[16..20].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// What a table copy says; `None` for one that is not whole (never written, or torn).
    pub fn decode_table(&self, b: &[u8]) -> Option<Table> {
        if b.len() < self.table_len() as usize || &b[..8] != TABLE_MAGIC {
            return None;
        }
        if u32_at(b, 16) != table_crc(&b[..self.table_len() as usize]) {
            return None;
        }
        let (head, entry) = (self.head(), self.entry());
        let mut t = Table {
            generation: u64_at(b, 8),
            place: if self.version > 1 { u64_at(b, 24) } else { 0 },
            ..Table::default()
        };
        for s in 0..self.slots as usize {
            let at = head + entry * s;
            let flags = u32_at(b, at + 8);
            if flags & LISTED != 0 {
                t.held.push((s, u64_at(b, at)));
            } else if flags & CLEAN != 0 && entry > 12 {
                t.clean.push((s, u64_at(b, at), u64_at(b, at + 16)));
            }
        }
        Some(t)
    }
}

/// The checksum of a table, its own field counted as zero.
fn table_crc(b: &[u8]) -> u32 {
    let crc = crc32c(0, &b[..16]);
    let crc = crc32c(crc, &[0; 4]);
    crc32c(crc, &b[20..])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_tables_read_back_and_damage_is_caught() {
        let l = Layout {
            object_size: 1 << 20,
            slots: 300,
            version: VERSION,
        };
        let h = l.encode_header("rbd/vm1");
        assert_eq!(Layout::decode_header(&h), Ok((l, "rbd/vm1".to_string())));
        let mut bad = h.clone();
        bad[20] ^= 1;
        assert!(Layout::decode_header(&bad)
            .unwrap_err()
            .contains("checksum"));
        assert!(Layout::decode_header(&h[..100]).is_err());
        let table = Table {
            generation: 7,
            place: 0xfeed,
            held: vec![(0, 5), (299, u64::MAX)],
            clean: vec![(3, 9, 1234)],
        };
        let t = l.encode_table(&table);
        assert_eq!(t.len() as u64, l.table_len());
        assert_eq!(l.decode_table(&t), Some(table.clone()));
        // A version 1 buffer keeps no clean copies, and its slots are where they were.
        let v1 = Layout { version: 1, ..l };
        let t1 = v1.encode_table(&table);
        let want = Table {
            place: 0,
            clean: Vec::new(),
            ..table
        };
        assert_eq!(v1.decode_table(&t1), Some(want));
        assert_eq!(
            v1.table_len(),
            (24 + 12 * 300usize).next_multiple_of(4096) as u64
        );
        let mut torn = t.clone();
        torn[l.head() + l.entry() * 299] ^= 1;
        assert_eq!(l.decode_table(&torn), None);
        assert_eq!(l.decode_table(&vec![0; t.len()]), None);
        assert_eq!(l.slot_at(1) - l.slot_at(0), 1 << 20);
        assert!(l.slot_at(0) >= l.table_at(1) + l.table_len());
    }
}
