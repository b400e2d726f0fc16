//! `forward_storage!`: the `Storage` methods a wrapper does not change, passed to the storage
//! it wraps. Wrappers (fault injection, blkdebug, the tests' storage that hold or watch some
//! requests) write out only the methods they change, and name the rest:
//!
//! ```ignore
//! impl Storage for Held {
//!     fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> { ... }
//!     vdisk::forward_storage!(inner: read_at, sync, allocate, punch_hole, len, set_len,
//!                             allocated_bytes, stats);
//! }
//! ```

/// Writes the named `Storage` methods of an `impl Storage` block as calls of the same method
/// on the field `$inner` (any `Storage`, or a reference or smart pointer to one).
#[macro_export]
macro_rules! forward_storage {
    ($inner:tt: $($method:ident),+ $(,)?) => {
        $($crate::forward_storage!(@one $inner $method);)+
    };
    (@one $inner:tt read_at) => {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.$inner.read_at(offset, buf)
        }
    };
    (@one $inner:tt write_at) => {
        fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
            self.$inner.write_at(offset, buf)
        }
    };
    (@one $inner:tt sync) => {
        fn sync(&self) -> std::io::Result<()> {
            self.$inner.sync()
        }
    };
    (@one $inner:tt allocate) => {
        fn allocate(&self, offset: u64, len: u64) -> std::io::Result<()> {
            self.$inner.allocate(offset, len)
        }
    };
    (@one $inner:tt punch_hole) => {
        fn punch_hole(&self, offset: u64, len: u64) -> std::io::Result<()> {
            self.$inner.punch_hole(offset, len)
        }
    };
    (@one $inner:tt len) => {
        fn len(&self) -> std::io::Result<u64> {
            self.$inner.len()
        }
    };
    (@one $inner:tt set_len) => {
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.$inner.set_len(len)
        }
    };
    (@one $inner:tt allocated_bytes) => {
        fn allocated_bytes(&self) -> std::io::Result<u64> {
            self.$inner.allocated_bytes()
        }
    };
    (@one $inner:tt fixed_size) => {
        fn fixed_size(&self) -> bool {
            self.$inner.fixed_size()
        }
    };
    (@one $inner:tt extent_at) => {
        fn extent_at(&self, offset: u64, len: u64) -> std::io::Result<(bool, u64)> {
            self.$inner.extent_at(offset, len)
        }
    };
    (@one $inner:tt is_allocated) => {
        fn is_allocated(&self, offset: u64, len: u64) -> std::io::Result<bool> {
            self.$inner.is_allocated(offset, len)
        }
    };
    (@one $inner:tt stats) => {
        fn stats(&self) -> &$crate::storage::IoStats {
            self.$inner.stats()
        }
    };
}
