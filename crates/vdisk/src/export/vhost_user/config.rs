//! What the device tells the driver about itself: virtio-blk's feature bits and configuration
//! space (virtio 1.2, 5.2.3 and 5.2.4), and the one field a driver may write (`writeback`).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

// Feature bits (virtio 1.2, 5.2.3 and 6).
const BLK_F_SEG_MAX: u64 = 1 << 2;
const BLK_F_RO: u64 = 1 << 5;
const BLK_F_BLK_SIZE: u64 = 1 << 6;
pub(super) const BLK_F_FLUSH: u64 = 1 << 9;
const BLK_F_TOPOLOGY: u64 = 1 << 10;
pub(super) const BLK_F_CONFIG_WCE: u64 = 1 << 11;
const BLK_F_MQ: u64 = 1 << 12;
const BLK_F_DISCARD: u64 = 1 << 13;
const BLK_F_WRITE_ZEROES: u64 = 1 << 14;
const F_INDIRECT_DESC: u64 = 1 << 28;
const F_EVENT_IDX: u64 = 1 << 29;
const F_VERSION_1: u64 = 1 << 32;

/// The guest's sector: offsets in requests count these.
pub(super) const SECTOR: u64 = 512;

/// Segments of one request at most (`seg_max`): a queue of QEMU's default size (128) less the
/// header and the status.
const SEG_MAX: u32 = 126;

/// Sectors one discard or write-zeroes segment covers at most, and segments per request.
const MAX_ZERO_SECTORS: u32 = 1 << 22;
pub(super) const MAX_ZERO_SEGMENTS: u32 = 64;

/// `struct virtio_blk_config` up to and including the secure-erase fields (QEMU asks for its
/// own size of it, which may be larger: the rest reads as zero).
const CONFIG_LEN: usize = 72;
/// Offset of `writeback`, the write cache enable the driver may change.
const WRITEBACK_AT: u32 = 32;

/// The device's identity and limits, fixed for an export.
#[derive(Debug, Clone)]
pub(super) struct Geometry {
    pub size: u64,
    pub read_only: bool,
    pub num_queues: u16,
    /// Requests are efficient in multiples of this (the image's cluster size).
    pub preferred_block: u32,
}

/// The features offered.
pub(super) fn features(g: &Geometry) -> u64 {
    let mut f = BLK_F_SEG_MAX
        | BLK_F_BLK_SIZE
        | BLK_F_FLUSH
        | BLK_F_TOPOLOGY
        | BLK_F_CONFIG_WCE
        | BLK_F_MQ
        | F_INDIRECT_DESC
        | F_EVENT_IDX
        | F_VERSION_1
        | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if g.read_only {
        f |= BLK_F_RO;
    } else {
        f |= BLK_F_DISCARD | BLK_F_WRITE_ZEROES;
    }
    f
}

/// The configuration space, `writeback` as the driver last set it.
pub(super) fn config(g: &Geometry, writeback: bool) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    let opt_io = (g.preferred_block as u64 / SECTOR).max(1) as u32;
    put(0, &(g.size / SECTOR).to_le_bytes()); // capacity
    put(12, &SEG_MAX.to_le_bytes());
    put(20, &(SECTOR as u32).to_le_bytes()); // blk_size
    put(24, &[3]); // physical_block_exp: 4 KiB physical blocks
    put(26, &1u16.to_le_bytes()); // min_io_size, in blk_size units
    put(28, &opt_io.to_le_bytes()); // opt_io_size
    put(32, &[u8::from(writeback)]);
    put(34, &g.num_queues.to_le_bytes());
    put(36, &MAX_ZERO_SECTORS.to_le_bytes()); // max_discard_sectors
    put(40, &MAX_ZERO_SEGMENTS.to_le_bytes()); // max_discard_seg
    put(44, &opt_io.to_le_bytes()); // discard_sector_alignment
    put(48, &MAX_ZERO_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
    put(52, &MAX_ZERO_SEGMENTS.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

/// `len` bytes of the configuration space from `offset`, zeroes past its end.
pub(super) fn read_config(g: &Geometry, writeback: bool, offset: u32, len: u32) -> Vec<u8> {
    let c = config(g, writeback);
    let mut out = vec![0u8; len as usize];
    let start = (offset as usize).min(c.len());
    let end = (offset as usize).saturating_add(len as usize).min(c.len());
    out[..end - start].copy_from_slice(&c[start..end]);
    out
}

/// The driver's write cache setting, true (writeback) until the driver turns it off.
#[derive(Debug)]
pub(super) struct WriteCache(AtomicBool);

impl Default for WriteCache {
    fn default() -> Self {
        WriteCache(AtomicBool::new(true))
    }
}

impl WriteCache {
    pub fn enabled(&self) -> bool {
        self.0.load(Relaxed)
    }

    /// A driver's write to the configuration space: only `writeback` may change.
    pub fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        match (offset, buf) {
            (WRITEBACK_AT, [v]) => {
                self.0.store(*v != 0, Relaxed);
                Ok(())
            }
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "virtio-blk: {} bytes at offset {offset} of the configuration are read-only",
                    buf.len()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_fields_land_where_the_spec_puts_them() {
        let g = Geometry {
            size: 1 << 30,
            read_only: false,
            num_queues: 4,
            preferred_block: 65536,
        };
        let c = config(&g, true);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 1 << 21);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(u32::from_le_bytes(c[28..32].try_into().unwrap()), 128);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(read_config(&g, false, 32, 4), vec![0, 0, 4, 0]);
        // Past the end reads as zero; a request reaching far past it is no panic.
        assert_eq!(read_config(&g, true, 70, 4), vec![0; 4]);
        assert_eq!(read_config(&g, true, u32::MAX, 8), vec![0; 8]);
        let f = features(&g);
        assert_ne!(f & BLK_F_DISCARD, 0);
        assert_eq!(f & BLK_F_RO, 0);
        let ro = features(&Geometry {
            read_only: true,
            ..g
        });
        assert_eq!(ro & (BLK_F_DISCARD | BLK_F_WRITE_ZEROES), 0);
        assert_ne!(ro & BLK_F_RO, 0);
    }

    #[test]
    fn only_writeback_is_writable() {
        let wc = WriteCache::default();
        assert!(wc.enabled());
        wc.set_config(32, &[0]).unwrap();
        assert!(!wc.enabled());
        assert!(wc.set_config(0, &[0; 8]).is_err());
        assert!(wc.set_config(32, &[1, 0]).is_err());
        wc.set_config(32, &[1]).unwrap();
        assert!(wc.enabled());
    }
}
