//! A virtio-blk request as a descriptor chain lays it out (virtio 1.2, 5.2.6): a 16-byte
//! header the driver wrote, the data, and one status byte the device writes. With VERSION_1 the
//! driver may split these across descriptors as it likes, so a chain is taken as bytes:
//! everything the device may read, then everything it may write.
//!
//! Nothing here trusts the driver: lengths are summed without overflow, a chain whose readable
//! and writable parts are interleaved, or that has no header or no status byte, is refused,
//! and guest addresses are only checked when the data moves (by vm-memory, region by region).

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap};

/// The guest's memory as the front end's table maps it, and the handle the crates share that
/// always holds its current version.
pub(super) type Memory = GuestMemoryMmap<()>;
pub(super) type Mem = GuestMemoryAtomic<Memory>;

// Request types and status values (virtio 1.2, 5.2.6).
pub(super) const T_IN: u32 = 0;
pub(super) const T_OUT: u32 = 1;
pub(super) const T_FLUSH: u32 = 4;
pub(super) const T_GET_ID: u32 = 8;
pub(super) const T_DISCARD: u32 = 11;
pub(super) const T_WRITE_ZEROES: u32 = 13;
pub(super) const S_OK: u8 = 0;
pub(super) const S_IOERR: u8 = 1;
pub(super) const S_UNSUPP: u8 = 2;

/// Bytes of a device ID (GET_ID).
pub(super) const ID_BYTES: usize = 20;
/// Bytes of a discard or write-zeroes segment.
pub(super) const ZERO_SEGMENT: usize = 16;
/// The write-zeroes flag that lets the device deallocate.
pub(super) const ZERO_FLAG_UNMAP: u32 = 1;

const HEADER: usize = 16;

/// A range of guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A request taken apart.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Request {
    pub kind: u32,
    pub sector: u64,
    /// What the driver gives after the header: data to write, discard or zero ranges.
    pub given: Vec<Segment>,
    /// Where the device puts what it returns before the status: data read, the ID.
    pub room: Vec<Segment>,
    pub status: GuestAddress,
}

/// Why a chain is not a request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Malformed {
    /// No writable byte for the status: nothing can be reported, the chain goes back as is.
    NoStatus,
    /// The status byte is known: it says IOERR.
    Bad {
        status: GuestAddress,
        why: &'static str,
    },
}

/// Takes apart a chain given as `(address, length, device-writable)` descriptors, reading the
/// header from `mem`.
pub(super) fn parse<M: GuestMemory>(
    mem: &M,
    descriptors: impl Iterator<Item = (GuestAddress, u32, bool)>,
) -> Result<Request, Malformed> {
    let mut given = Vec::new();
    let mut room = Vec::new();
    let mut interleaved = false;
    for (addr, len, writable) in descriptors {
        if len == 0 {
            continue;
        }
        let seg = Segment { addr, len };
        if writable {
            room.push(seg);
        } else if room.is_empty() {
            given.push(seg);
        } else {
            interleaved = true;
        }
    }
    let status = last_byte(&mut room).ok_or(Malformed::NoStatus)?;
    let bad = |why| Malformed::Bad { status, why };
    if interleaved {
        return Err(bad("readable descriptors after writable ones"));
    }
    let header_segs = split_front(&mut given, HEADER).ok_or(bad("no request header"))?;
    let mut header = [0u8; HEADER];
    read_segments(mem, &header_segs, &mut header)
        .map_err(|_| bad("header outside guest memory"))?;
    Ok(Request {
        kind: u32::from_le_bytes(header[0..4].try_into().unwrap_or_default()),
        sector: u64::from_le_bytes(header[8..16].try_into().unwrap_or_default()),
        given,
        room,
        status,
    })
}

/// The total length of `segs`.
pub(super) fn total(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Removes the last byte of `segs` and returns its address.
fn last_byte(segs: &mut Vec<Segment>) -> Option<GuestAddress> {
    let last = segs.last_mut()?;
    let addr = last.addr.checked_add(u64::from(last.len) - 1)?;
    last.len -= 1;
    if last.len == 0 {
        segs.pop();
    }
    Some(addr)
}

/// Removes the first `n` bytes of `segs` and returns them as segments; `None` when `segs` is
/// shorter.
fn split_front(segs: &mut Vec<Segment>, n: usize) -> Option<Vec<Segment>> {
    let mut front = Vec::new();
    let mut left = n as u64;
    let mut i = 0;
    while left > 0 {
        let s = segs.get_mut(i)?;
        let take = u64::from(s.len).min(left);
        front.push(Segment {
            addr: s.addr,
            len: take as u32,
        });
        left -= take;
        if take == u64::from(s.len) {
            i += 1;
        } else {
            s.addr = s.addr.checked_add(take)?;
            s.len -= take as u32;
        }
    }
    segs.drain(..i);
    Some(front)
}

/// Copies guest memory `segs` into `buf`, as far as either goes.
pub(super) fn read_segments<M: GuestMemory>(
    mem: &M,
    segs: &[Segment],
    buf: &mut [u8],
) -> Result<(), vm_memory::GuestMemoryError> {
    let mut at = 0;
    for s in segs {
        let n = (s.len as usize).min(buf.len() - at);
        mem.read_slice(&mut buf[at..at + n], s.addr)?;
        at += n;
        if at == buf.len() {
            break;
        }
    }
    Ok(())
}

/// Copies `buf` into guest memory `segs`, as far as either goes.
pub(super) fn write_segments<M: GuestMemory>(
    mem: &M,
    segs: &[Segment],
    buf: &[u8],
) -> Result<(), vm_memory::GuestMemoryError> {
    let mut at = 0;
    for s in segs {
        let n = (s.len as usize).min(buf.len() - at);
        mem.write_slice(&buf[at..at + n], s.addr)?;
        at += n;
        if at == buf.len() {
            break;
        }
    }
    Ok(())
}

/// The guest memory of `segs` as host byte slices (neighbours that are contiguous in this
/// process joined), each with its offset in the request; `None` when one is not all in one
/// region of guest memory.
///
/// The slices alias memory the guest can write: they are its buffers for this request, which
/// the driver hands to the device until the request completes, and the engine only copies
/// them to or from the file. A driver that touches them meanwhile, or names the same memory
/// in two requests in flight at once, breaks the rule that a `&mut` is unique: the bytes
/// moved are then whatever the races make them, which only the driver's own data suffers, as
/// with any device's DMA. They must not outlive `mem`, whose mapping they point into.
// Guest memory is shared memory the mapping lets us write through a shared reference.
#[allow(clippy::mut_from_ref)]
pub(super) fn guest_slices<'m, M: vm_memory::GuestMemoryBackend>(
    mem: &'m M,
    segs: &[Segment],
) -> Option<Vec<(u64, &'m mut [u8])>> {
    let mut out: Vec<(u64, *mut u8, usize)> = Vec::new();
    let mut at = 0u64;
    for s in segs {
        let slice = mem.get_slice(s.addr, s.len as usize).ok()?;
        let ptr = slice.ptr_guard_mut().as_ptr();
        match out.last_mut() {
            Some((_, p, n)) if p.wrapping_add(*n) == ptr => *n += s.len as usize,
            _ => out.push((at, ptr, s.len as usize)),
        }
        at += u64::from(s.len);
    }
    let slices = out
        .into_iter()
        // SAFETY: each range was checked to lie in one region of `mem`, mapped for as long as
        // `mem` lives; joined ranges are contiguous in this process; distinct descriptors of a
        // request do not overlap unless the driver made them so, which only garbles its own
        // data (see above).
        .map(|(at, ptr, n)| (at, unsafe { std::slice::from_raw_parts_mut(ptr, n) }))
        .collect();
    Some(slices)
}

/// The byte offset of `len` bytes at `sector`, if they lie within a disk of `size` bytes.
pub(super) fn range(size: u64, sector: u64, len: u64) -> Option<u64> {
    let offset = sector.checked_mul(super::config::SECTOR)?;
    (offset.checked_add(len)? <= size).then_some(offset)
}

/// The byte ranges of a DISCARD or WRITE_ZEROES request (segments of sector, sectors,
/// flags), or the status that refuses it.
pub(super) fn zero_ranges(mem: &Memory, req: &Request, size: u64) -> Result<Vec<(u64, u64)>, u8> {
    let len = total(&req.given) as usize;
    if len == 0
        || len % ZERO_SEGMENT != 0
        || len / ZERO_SEGMENT > super::config::MAX_ZERO_SEGMENTS as usize
    {
        return Err(S_IOERR);
    }
    let mut raw = vec![0u8; len];
    read_segments(mem, &req.given, &mut raw).map_err(|_| S_IOERR)?;
    // Discard has no flags; write zeroes only "may unmap" (virtio 1.2, 5.2.6.2).
    let allowed = if req.kind == T_DISCARD {
        0
    } else {
        ZERO_FLAG_UNMAP
    };
    raw.chunks_exact(ZERO_SEGMENT)
        .map(|seg| {
            let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap_or_default());
            let count = u32::from_le_bytes(seg[8..12].try_into().unwrap_or_default());
            let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap_or_default());
            if flags & !allowed != 0 {
                return Err(S_UNSUPP);
            }
            let bytes = u64::from(count) * super::config::SECTOR;
            range(size, sector, bytes)
                .map(|offset| (offset, bytes))
                .ok_or(S_IOERR)
        })
        .collect()
}

pub(super) fn status_of(r: crate::Result<()>) -> u8 {
    if r.is_ok() {
        S_OK
    } else {
        S_IOERR
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0x1000), 0x10000)]).unwrap()
    }

    fn header(mem: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn seg(addr: u64, len: u32) -> Segment {
        Segment {
            addr: GuestAddress(addr),
            len,
        }
    }

    #[test]
    fn the_usual_layout_and_a_split_one_give_the_same_request() {
        let m = mem();
        header(&m, 0x1000, T_OUT, 77);
        let usual = [
            (GuestAddress(0x1000), 16, false),
            (GuestAddress(0x2000), 4096, false),
            (GuestAddress(0x4000), 1, true),
        ];
        let r = parse(&m, usual.into_iter()).unwrap();
        assert_eq!((r.kind, r.sector), (T_OUT, 77));
        assert_eq!(r.given, vec![seg(0x2000, 4096)]);
        assert!(r.room.is_empty());
        assert_eq!(r.status, GuestAddress(0x4000));

        // Header and data in one descriptor, data and status in one writable descriptor.
        header(&m, 0x3000, T_IN, 9);
        let merged = [
            (GuestAddress(0x3000), 16, false),
            (GuestAddress(0x5000), 513, true),
        ];
        let r = parse(&m, merged.into_iter()).unwrap();
        assert_eq!((r.kind, r.sector), (T_IN, 9));
        assert_eq!(r.room, vec![seg(0x5000, 512)]);
        assert_eq!(r.status, GuestAddress(0x5200));

        let split_header = [
            (GuestAddress(0x3000), 8, false),
            (GuestAddress(0x3008), 8 + 100, false),
            (GuestAddress(0x6000), 1, true),
        ];
        let r = parse(&m, split_header.into_iter()).unwrap();
        assert_eq!((r.kind, r.sector), (T_IN, 9));
        assert_eq!(r.given, vec![seg(0x3010, 100)]);
    }

    #[test]
    fn broken_chains_are_refused_without_panic() {
        let m = mem();
        header(&m, 0x1000, T_IN, 0);
        let none: [(GuestAddress, u32, bool); 0] = [];
        assert_eq!(parse(&m, none.into_iter()), Err(Malformed::NoStatus));
        let no_status = [(GuestAddress(0x1000), 16, false)];
        assert_eq!(parse(&m, no_status.into_iter()), Err(Malformed::NoStatus));
        let short_header = [
            (GuestAddress(0x1000), 15, false),
            (GuestAddress(0x4000), 1, true),
        ];
        assert!(matches!(
            parse(&m, short_header.into_iter()),
            Err(Malformed::Bad { .. })
        ));
        let interleaved = [
            (GuestAddress(0x1000), 16, false),
            (GuestAddress(0x4000), 512, true),
            (GuestAddress(0x2000), 512, false),
            (GuestAddress(0x5000), 1, true),
        ];
        assert!(matches!(
            parse(&m, interleaved.into_iter()),
            Err(Malformed::Bad { .. })
        ));
        let header_outside = [
            (GuestAddress(0xffff_0000), 16, false),
            (GuestAddress(0x4000), 1, true),
        ];
        assert!(matches!(
            parse(&m, header_outside.into_iter()),
            Err(Malformed::Bad { .. })
        ));
        // A status byte at the very top of the address space does not wrap.
        let top = [
            (GuestAddress(0x1000), 16, false),
            (GuestAddress(u64::MAX), u32::MAX, true),
        ];
        assert_eq!(parse(&m, top.into_iter()), Err(Malformed::NoStatus));
        // Data outside guest memory fails when it moves, not before.
        let mut buf = [0u8; 8];
        assert!(read_segments(&m, &[seg(0x20000, 8)], &mut buf).is_err());
        assert!(write_segments(&m, &[seg(0x20000, 8)], &buf).is_err());
    }

    #[test]
    fn guest_slices_join_neighbours_and_refuse_what_is_not_mapped() {
        let m = mem();
        let segs = [seg(0x2000, 512), seg(0x2200, 512), seg(0x8000, 100)];
        let slices = guest_slices(&m, &segs).unwrap();
        let shape: Vec<(u64, usize)> = slices.iter().map(|(at, s)| (*at, s.len())).collect();
        assert_eq!(shape, vec![(0, 1024), (1024, 100)]);
        drop(slices);
        assert!(guest_slices(&m, &[seg(0x2000, 512), seg(0x10f00, 512)]).is_none());
        assert!(guest_slices(&m, &[seg(u64::MAX - 10, 100)]).is_none());
    }
}
