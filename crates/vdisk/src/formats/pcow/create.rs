//! New pcow images: the super cluster and nothing else (thin provisioning: the file grows by
//! the clusters written).

use super::layout::{Base, Geometry, Super, MAX_BASE_NAME, MAX_CLUSTER_KIB, MIN_CLUSTER_KIB};
use crate::error::{Error, IoContext, Result};
use crate::storage::Storage;

/// What `vdisk create -f pcow [-o cluster_size=] [-b BASE -F FMT]` chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateOptions {
    /// The guest disk's size; rounded up to whole sectors.
    pub size: u64,
    /// Bytes per cluster: a power of two from 4 KiB to 2 MiB, 64 KiB by default (the paper's).
    pub cluster_size: u64,
    pub base: Option<Base>,
}

impl Default for CreateOptions {
    fn default() -> CreateOptions {
        CreateOptions {
            size: 0,
            cluster_size: 64 << 10,
            base: None,
        }
    }
}

impl CreateOptions {
    /// The super cluster of an image made with these options (its id left zero).
    pub fn superblock(&self) -> Result<Super> {
        let cs = self.cluster_size;
        let kib = u32::try_from(cs >> 10).unwrap_or(0);
        if cs % 1024 != 0
            || !kib.is_power_of_two()
            || !(MIN_CLUSTER_KIB..=MAX_CLUSTER_KIB).contains(&kib)
        {
            return Err(Error::invalid(format!(
                "pcow cluster size {cs} is not a power of two from 4 KiB to 2 MiB"
            )));
        }
        let size = self.size.next_multiple_of(512);
        let clusters = u32::try_from(size.div_ceil(cs)).map_err(|_| {
            Error::invalid(format!(
                "a pcow image of {size} bytes needs more than 2^32 clusters of {cs} bytes"
            ))
        })?;
        let geo = Geometry::new(kib, clusters, size).map_err(Error::invalid)?;
        if let Some(b) = &self.base {
            if b.name.is_empty() || b.name.len() > MAX_BASE_NAME || b.name.contains('\0') {
                return Err(Error::invalid(format!(
                    "a pcow base image name is 1 to {MAX_BASE_NAME} bytes, without NUL"
                )));
            }
            if b.format
                .as_ref()
                .is_some_and(|f| f.len() > 16 || f.contains('\0'))
            {
                return Err(Error::invalid("a pcow base format is at most 16 bytes"));
            }
        }
        Ok(Super {
            geo,
            segments: 0,
            image_id: 0,
            base: self.base.clone(),
        })
    }
}

/// Writes a new pcow image into `storage` (cut first if it holds anything).
pub fn create(storage: &dyn Storage, o: &CreateOptions) -> Result<()> {
    let sb = Super {
        image_id: random_id(),
        ..o.superblock()?
    };
    let what = || "creating the pcow image".to_string();
    if !storage.is_empty().context(what)? {
        storage.set_len(0).context(what)?;
    }
    let mut cluster = sb.encode();
    cluster.resize(sb.geo.cluster as usize, 0);
    storage.write_at(0, &cluster).context(what)?;
    storage.sync().context(what)
}

/// A random image id, so that headers of another image (say, one stored in a guest's data)
/// are never taken for this one's.
fn random_id() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(b);
    }
    // Without the kernel's generator, the time and the process still tell images apart.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ u64::from(std::process::id()).rotate_left(40)
}
