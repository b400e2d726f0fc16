//! Byte-buffer helpers shared by the formats and the tools.

/// Whether `block` is all zero bytes, tested a machine word at a time.
pub fn is_zero(block: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u64, so viewing the aligned middle as u64s is sound.
    let (head, words, tail) = unsafe { block.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Zero bytes to write from where zeroes must be written, not punched, in chunks of up to this.
pub static ZEROES: [u8; ZERO_CHUNK] = [0; ZERO_CHUNK];
pub const ZERO_CHUNK: usize = 1 << 20;

/// An alignment of offsets, lengths and buffer addresses that O_DIRECT transfers accept on
/// every logical block size Linux supports for regular files' devices: the one buffers are
/// allocated with, and the one used where the file system does not tell its own.
pub const DIRECT_ALIGN: usize = 4096;

/// A zero-filled heap buffer whose address is aligned to [`DIRECT_ALIGN`], so
/// that a storage opened for direct I/O can move it without the page cache.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least one byte is always allocated).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), DIRECT_ALIGN)
            .expect("buffer size fits the address space")
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned exclusively by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}
