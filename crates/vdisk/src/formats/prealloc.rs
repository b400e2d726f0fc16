//! How much of a new or grown image is allocated up front (qemu-img's `preallocation`), for
//! every format.

use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

/// How much of a new image is allocated up front (qemu-img's `preallocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preallocation {
    #[default]
    Off,
    /// L2 tables and data clusters are allocated; the file stays sparse.
    Metadata,
    /// As metadata, and the file's space is reserved with fallocate.
    Falloc,
    /// As metadata, and the data clusters are written with zeroes.
    Full,
}

impl Preallocation {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Preallocation::Off),
            "metadata" => Ok(Preallocation::Metadata),
            "falloc" => Ok(Preallocation::Falloc),
            "full" => Ok(Preallocation::Full),
            other => Err(Error::invalid(format!("Invalid parameter '{other}'"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preallocation::Off => "off",
            Preallocation::Metadata => "metadata",
            Preallocation::Falloc => "falloc",
            Preallocation::Full => "full",
        }
    }
}

/// Reserves or fills `[start, end)` of `storage` as the preallocation mode asks and makes the
/// storage at least `end` bytes long.
pub(crate) fn preallocate(
    storage: &dyn Storage,
    start: u64,
    end: u64,
    mode: Preallocation,
) -> Result<()> {
    let what = || "preallocating the new image".to_string();
    match mode {
        Preallocation::Off | Preallocation::Metadata => {
            if storage.len().context(what)? < end {
                storage.set_len(end).context(what)?;
            }
        }
        Preallocation::Falloc if end > start => {
            storage.allocate(start, end - start).context(what)?
        }
        Preallocation::Falloc => {}
        Preallocation::Full => {
            write_zeroes(storage, &vec![0u8; 1 << 20], start, end).context(what)?
        }
    }
    Ok(())
}

/// Writes `[from, to)` of `storage` with zeroes, `zeroes.len()` bytes a request (data, not
/// holes or unwritten extents: the file system allocates it now, not at a later write).
pub(crate) fn write_zeroes(
    storage: &dyn Storage,
    zeroes: &[u8],
    from: u64,
    to: u64,
) -> std::io::Result<()> {
    let mut at = from;
    while at < to {
        let n = zeroes.len().min((to - at) as usize);
        storage.write_at(at, &zeroes[..n])?;
        at += n as u64;
    }
    Ok(())
}
