//! Where a read's or write's bytes live while the I/O queue moves them: in a buffer of ours,
//! or, when the request's data is one stretch of guest memory, in the guest's memory itself,
//! so that the kernel moves them between the disk and the guest with no copy of ours.

use std::sync::Arc;

use super::request::{guest_slices, Mem, Memory, Segment};
use crate::io::pool::Buf;
use crate::io::IoBuf;

/// Guest memory is used in place only at this alignment: what a driver's page-sized buffers
/// have, and what O_DIRECT asks of memory (an unaligned buffer would make the queue fall
/// back to a blocking call on the worker's thread).
const IN_PLACE_ALIGN: usize = 4096;

pub(super) enum Data {
    Ours(Buf),
    /// `len` bytes of guest memory at `ptr`, in a mapping `mem` keeps alive (regions the
    /// front end removes meanwhile stay mapped until the request lets go).
    Guest {
        ptr: *mut u8,
        len: usize,
        _mem: Arc<Memory>,
    },
}

// SAFETY: the pointer is into a shared mapping that the `Arc` keeps alive wherever the value
// goes; a `Buf` is `Send` itself.
unsafe impl Send for Data {}

impl Data {
    /// The guest memory of `segs` in place, if it is one aligned stretch of one region.
    pub fn in_place(mem: &Mem, segs: &[Segment]) -> Option<Data> {
        let mem = vm_memory::GuestAddressSpace::memory(mem).into_inner();
        let (ptr, len) = match guest_slices(&*mem, segs)?.as_mut_slice() {
            [(_, slice)] => (slice.as_mut_ptr(), slice.len()),
            _ => return None,
        };
        (ptr as usize % IN_PLACE_ALIGN == 0).then_some(Data::Guest {
            ptr,
            len,
            _mem: mem,
        })
    }
}

// SAFETY: a `Buf`'s bytes are its heap block's; guest memory stays mapped at `ptr` while the
// `Arc` lives. The guest's bytes may change under us as `guest_slices` describes: only the
// driver's own data suffers, as with any device's DMA.
unsafe impl IoBuf for Data {
    fn bytes(&self) -> &[u8] {
        match self {
            Data::Ours(b) => b,
            // SAFETY: see the impl.
            Data::Guest { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Data::Ours(b) => b,
            // SAFETY: see the impl.
            Data::Guest { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}
