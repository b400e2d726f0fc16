//! virtio-blk requests (virtio 1.2, 5.2.6) placed in a queue's buffer memory: each request
//! slot holds a 16-byte header, a status byte and room for its data.

use crate::device::Queue;
use crate::memory::GuestRam;
use crate::ring::Buffer;

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
pub const S_OK: u8 = 0;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    /// Discard or write zeroes of `len` bytes; `unmap` lets the device deallocate.
    Zero {
        discard: bool,
        unmap: bool,
    },
    GetId,
}

/// Request slots over a queue's buffer memory.
pub struct Slots {
    base: u64,
    slot_size: u64,
    pub count: u16,
    pub data_max: u32,
    /// Descriptors a read's or write's data is cut into, laid out in reverse order in the
    /// slot (no two neighbours in the order of the chain), as a guest's scattered pages are.
    pub segments: u16,
}

impl Slots {
    /// As many slots of `data_max` bytes of data as `q`'s buffers hold, at most `count`.
    pub fn new(q: &Queue, count: u16, data_max: u32) -> Slots {
        let slot_size = 4096 + u64::from(data_max).next_multiple_of(4096);
        let fits = (q.buffers_len / slot_size).min(u64::from(count)) as u16;
        Slots {
            base: q.buffers,
            slot_size,
            count: fits,
            data_max,
            segments: 1,
        }
    }

    /// The same slots with data cut into `n` descriptors (at least 1).
    pub fn with_segments(self, n: u16) -> Slots {
        Slots {
            segments: n.max(1),
            ..self
        }
    }

    fn header(&self, slot: u16) -> u64 {
        self.base + u64::from(slot) * self.slot_size
    }

    fn status_at(&self, slot: u16) -> u64 {
        self.header(slot) + 16
    }

    /// Guest address of the slot's data.
    pub fn data(&self, slot: u16) -> u64 {
        self.header(slot) + 4096
    }

    /// Places request `op` of `len` bytes at `sector` in `slot` and adds it to `q` (not yet
    /// published). Returns the chain's head.
    pub fn add(
        &self,
        ram: &GuestRam,
        q: &mut Queue,
        slot: u16,
        op: Op,
        sector: u64,
        len: u32,
    ) -> Option<u16> {
        let mut h = [0u8; 16];
        let kind = match op {
            Op::Read => T_IN,
            Op::Write => T_OUT,
            Op::Flush => T_FLUSH,
            Op::Zero { discard: true, .. } => T_DISCARD,
            Op::Zero { .. } => T_WRITE_ZEROES,
            Op::GetId => T_GET_ID,
        };
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        ram.write(self.header(slot), &h);
        ram.write(self.status_at(slot), &[0xff]);
        let header = Buffer {
            addr: self.header(slot),
            len: 16,
            device_writes: false,
        };
        let status = Buffer {
            addr: self.status_at(slot),
            len: 1,
            device_writes: true,
        };
        let data = |device_writes| Buffer {
            addr: self.data(slot),
            len,
            device_writes,
        };
        // Pieces of whole sectors; the last takes what is left.
        let scattered = |device_writes| {
            let n = u32::from(self.segments).min(len / 512).max(1);
            let piece = len / n / 512 * 512;
            let mut chain = vec![header];
            for i in 0..n {
                let size = if i + 1 == n { len - piece * i } else { piece };
                // Piece i sits after the pieces that follow it in the chain.
                let at = u64::from(len - piece * i - size);
                chain.push(Buffer {
                    addr: self.data(slot) + at,
                    len: size,
                    device_writes,
                });
            }
            chain.push(status);
            chain
        };
        let chain = match op {
            Op::Read if self.segments > 1 => scattered(true),
            Op::Write if self.segments > 1 => scattered(false),
            Op::Read => vec![header, data(true), status],
            Op::Write => vec![header, data(false), status],
            Op::Flush => vec![header, status],
            Op::GetId => vec![
                header,
                Buffer {
                    len: 20,
                    ..data(true)
                },
                status,
            ],
            Op::Zero { unmap, .. } => {
                let mut seg = [0u8; 16];
                seg[0..8].copy_from_slice(&sector.to_le_bytes());
                seg[8..12].copy_from_slice(&(len / 512).to_le_bytes());
                seg[12..16].copy_from_slice(&u32::from(unmap).to_le_bytes());
                ram.write(self.data(slot), &seg);
                vec![
                    header,
                    Buffer {
                        len: 16,
                        ..data(false)
                    },
                    status,
                ]
            }
        };
        q.ring.add(&chain)
    }

    /// The status byte the device wrote for `slot` (0xff: none yet).
    pub fn status(&self, ram: &GuestRam, slot: u16) -> u8 {
        let mut b = [0u8; 1];
        ram.read(self.status_at(slot), &mut b);
        b[0]
    }
}
