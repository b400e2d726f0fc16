//! The driver's side of a split virtqueue (virtio 1.2, 2.7): a descriptor table, the available
//! ring the driver fills and the used ring the device fills, laid out in guest memory. No
//! indirect descriptors, no event index: every batch is kicked, every completion called.

use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::Arc;

use crate::memory::GuestRam;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// One buffer of a chain: guest address, length, whether the device writes it.
#[derive(Debug, Clone, Copy)]
pub struct Buffer {
    pub addr: u64,
    pub len: u32,
    pub device_writes: bool,
}

pub struct SplitQueue {
    ram: Arc<GuestRam>,
    size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    free: Vec<u16>,
    /// Each descriptor's successor in its chain (ours: the device may not change it).
    next: Vec<u16>,
    chain_len: Vec<u16>,
    next_avail: u16,
    last_used: u16,
}

impl SplitQueue {
    /// Guest bytes a queue of `size` needs.
    pub fn bytes(size: u16) -> u64 {
        let n = u64::from(size);
        let avail = 16 * n;
        let used = (avail + 6 + 2 * n + 3) & !3;
        used + 6 + 8 * n
    }

    /// A queue of `size` (a power of two) laid out at guest address `at`, zeroed.
    pub fn new(ram: Arc<GuestRam>, at: u64, size: u16) -> SplitQueue {
        assert!(size.is_power_of_two());
        ram.fill(at, SplitQueue::bytes(size) as usize, 0);
        let n = u64::from(size);
        let avail = at + 16 * n;
        let used = (avail + 6 + 2 * n + 3) & !3;
        SplitQueue {
            ram,
            size,
            desc: at,
            avail,
            used,
            free: (0..size).rev().collect(),
            next: vec![0; size as usize],
            chain_len: vec![0; size as usize],
            next_avail: 0,
            last_used: 0,
        }
    }

    pub fn size(&self) -> u16 {
        self.size
    }

    /// Free descriptors.
    pub fn room(&self) -> usize {
        self.free.len()
    }

    /// Places a chain and makes it available (the device sees it after [`SplitQueue::publish`]).
    /// `None` when too few descriptors are free.
    pub fn add(&mut self, chain: &[Buffer]) -> Option<u16> {
        if chain.is_empty() || chain.len() > self.free.len() {
            return None;
        }
        let ids: Vec<u16> = (0..chain.len()).filter_map(|_| self.free.pop()).collect();
        for (i, b) in chain.iter().enumerate() {
            let mut flags = if b.device_writes { F_WRITE } else { 0 };
            let next = ids.get(i + 1).copied().unwrap_or(0);
            if i + 1 < chain.len() {
                flags |= F_NEXT;
            }
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&b.addr.to_le_bytes());
            d[8..12].copy_from_slice(&b.len.to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.to_le_bytes());
            self.ram.write(self.desc + 16 * u64::from(ids[i]), &d);
            self.next[ids[i] as usize] = next;
        }
        let head = ids[0];
        self.chain_len[head as usize] = chain.len() as u16;
        let slot = u64::from(self.next_avail % self.size);
        self.ram
            .write(self.avail + 4 + 2 * slot, &head.to_le_bytes());
        self.next_avail = self.next_avail.wrapping_add(1);
        Some(head)
    }

    /// Shows the device every chain added so far.
    pub fn publish(&self) {
        self.ram.store_u16(self.avail + 2, self.next_avail, Release);
    }

    /// The next chain the device returned: its head and the bytes it wrote. A head the device
    /// invents is reported as an error.
    pub fn pop_used(&mut self) -> Option<Result<(u16, u32), String>> {
        let used_idx = self.ram.load_u16(self.used + 2, Acquire);
        if used_idx == self.last_used {
            return None;
        }
        let slot = u64::from(self.last_used % self.size);
        let id = self.ram.read_u32(self.used + 4 + 8 * slot);
        let len = self.ram.read_u32(self.used + 8 + 8 * slot);
        self.last_used = self.last_used.wrapping_add(1);
        let head = match u16::try_from(id) {
            Ok(h) if h < self.size && self.chain_len[h as usize] > 0 => h,
            _ => return Some(Err(format!("device returned unknown descriptor {id}"))),
        };
        let mut d = head;
        for _ in 0..std::mem::take(&mut self.chain_len[head as usize]) {
            self.free.push(d);
            d = self.next[d as usize];
        }
        Some(Ok((head, len)))
    }

    /// A hostile driver's move: writes raw 16-byte descriptors at the given indices, makes
    /// `head` available and publishes it. The chain bookkeeping of [`SplitQueue::add`] is left
    /// alone: a queue used this way takes only raw chains.
    pub fn put_raw(&mut self, descriptors: &[(u16, [u8; 16])], head: u16) {
        for (i, d) in descriptors {
            self.ram.write(self.desc + 16 * u64::from(i % self.size), d);
        }
        let slot = u64::from(self.next_avail % self.size);
        self.ram
            .write(self.avail + 4 + 2 * slot, &head.to_le_bytes());
        self.next_avail = self.next_avail.wrapping_add(1);
        self.publish();
    }

    /// The next used entry as the device wrote it (descriptor id, length), unchecked.
    pub fn pop_used_raw(&mut self) -> Option<(u32, u32)> {
        let used_idx = self.ram.load_u16(self.used + 2, Acquire);
        if used_idx == self.last_used {
            return None;
        }
        let slot = u64::from(self.last_used % self.size);
        self.last_used = self.last_used.wrapping_add(1);
        Some((
            self.ram.read_u32(self.used + 4 + 8 * slot),
            self.ram.read_u32(self.used + 8 + 8 * slot),
        ))
    }
}
