//! vdisk: a user-space virtual-disk engine.
//!
//! Layers, top to bottom (see DESIGN.md): [`blockdev`] is the interface every format implements
//! and every export consumes; [`formats`] turn guest offsets into storage offsets; [`storage`]
//! is the only layer that touches the host.

pub mod blockdev;
pub mod bytes;
pub mod cache;
pub mod checksum;
pub mod counters;
pub mod crypto;
pub mod error;
pub mod export;
pub mod formats;
mod gate;
pub mod guestfs;
pub mod io;
pub mod pmem;
pub mod rng;
pub mod spec;
pub mod storage;
pub mod sync;

pub use blockdev::{BlockDev, BlockStatus, StartedRead, StartedWrite, Transfer};
pub use cache::{CacheMode, WithCache};
pub use counters::{Counters, CountersSnapshot, FormatStat, StatValue};
pub use error::{Error, Result};
pub use formats::{
    backing_path, open_image, open_overlay, open_parts, open_storage, open_storage_with, Driver,
    Format, Image, ImageOptions, Preallocation,
};
pub use storage::WriteHint;
