//! The bitmap directory: its entries read as QEMU's `bitmap_list_load` reads them (and refuses
//! them), and written back as `bitmap_list_store` writes them; the header extension naming it.

use super::{location, within_constraints, ENTRY_HEADER, EXTENSION, FLAG_IN_USE};
use crate::error::{Error, IoContext, Result};
use crate::formats::qcow2::header::{Header, UnknownExtension, AUTOCLEAR_BITMAPS};
use crate::storage::Storage;

/// One bitmap of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub table_offset: u64,
    pub table_size: u32,
    pub flags: u32,
    pub granularity_bits: u8,
    pub name: Vec<u8>,
}

impl Entry {
    pub fn in_use(&self) -> bool {
        self.flags & FLAG_IN_USE != 0
    }

    /// Bytes of the table.
    pub fn table_bytes(&self) -> u64 {
        u64::from(self.table_size) * 8
    }
}

/// The directory's entries (none when the autoclear bit does not vouch for them), refused in
/// QEMU's words where its open refuses them: an entry that does not fit, extra data, a count
/// other than the header's, or an entry outside QEMU's constraints.
pub fn read(file: &dyn Storage, h: &Header) -> Result<Vec<Entry>> {
    let Some(loc) = location(h).filter(|l| l.entries > 0) else {
        return Ok(Vec::new());
    };
    let file_len = file.len().context(|| "reading the image size".into())?;
    let dir = loc.read(file, file_len)?;
    let broken = || Error::corrupt("Broken bitmap directory");
    let mut out = Vec::new();
    let mut at = 0;
    while at < dir.len() {
        let e = dir.get(at..at + ENTRY_HEADER).ok_or_else(broken)?;
        if out.len() as u32 >= loc.entries {
            return Err(Error::corrupt(
                "More bitmaps found than specified in header extension",
            ));
        }
        let be32 = |i: usize| u32::from_be_bytes(e[i..i + 4].try_into().expect("4 bytes"));
        let name_bytes = u16::from_be_bytes([e[18], e[19]]);
        let extra = be32(20);
        let size =
            (ENTRY_HEADER as u64 + u64::from(name_bytes) + u64::from(extra)).next_multiple_of(8);
        if at as u64 + size > dir.len() as u64 {
            return Err(broken());
        }
        let name = &dir[at + ENTRY_HEADER..at + ENTRY_HEADER + usize::from(name_bytes)];
        if extra != 0 {
            return Err(Error::unsupported("Bitmap extra data is not supported"));
        }
        if !within_constraints(e, h) {
            return Err(Error::corrupt(format!(
                "Bitmap '{}' doesn't satisfy the constraints",
                String::from_utf8_lossy(name)
            )));
        }
        out.push(Entry {
            table_offset: u64::from_be_bytes(e[0..8].try_into().expect("8 bytes")),
            table_size: be32(8),
            flags: be32(12),
            granularity_bits: e[17],
            name: name.to_vec(),
        });
        at += size as usize;
    }
    if out.len() as u32 != loc.entries {
        return Err(Error::corrupt(
            "Less bitmaps found than specified in header extension",
        ));
    }
    Ok(out)
}

/// The directory's bytes, entries 8-byte aligned, as QEMU writes it.
pub fn to_bytes(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        out.extend_from_slice(&e.table_offset.to_be_bytes());
        out.extend_from_slice(&e.table_size.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
        out.push(super::DIRTY_TRACKING);
        out.push(e.granularity_bits);
        out.extend_from_slice(&(e.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(&e.name);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out
}

/// Points header `h` at a directory of `entries` entries, `bytes` long at `offset`, or drops
/// the extension and the autoclear bit when there are none. As in QEMU, the extension comes
/// before every other extension vdisk does not know.
pub fn set_extension(h: &mut Header, entries: u32, offset: u64, bytes: u64) {
    h.unknown_extensions.retain(|e| e.kind != EXTENSION);
    if entries == 0 {
        h.autoclear &= !AUTOCLEAR_BITMAPS;
        return;
    }
    let mut data = Vec::with_capacity(24);
    data.extend_from_slice(&entries.to_be_bytes());
    data.extend_from_slice(&0u32.to_be_bytes());
    data.extend_from_slice(&bytes.to_be_bytes());
    data.extend_from_slice(&offset.to_be_bytes());
    let ext = UnknownExtension {
        kind: EXTENSION,
        data,
    };
    h.unknown_extensions.insert(0, ext);
    h.autoclear |= AUTOCLEAR_BITMAPS;
}

#[cfg(test)]
mod tests {
    use super::{to_bytes, Entry};

    #[test]
    fn entries_are_padded_to_8_bytes() {
        let e = Entry {
            table_offset: 0x30000,
            table_size: 1,
            flags: 2,
            granularity_bits: 16,
            name: b"b1".to_vec(),
        };
        let bytes = to_bytes(&[e.clone(), e]);
        assert_eq!(bytes.len(), 64);
        assert_eq!(&bytes[16..20], &[1, 16, 0, 2]);
        assert_eq!(&bytes[24..26], b"b1");
    }
}
