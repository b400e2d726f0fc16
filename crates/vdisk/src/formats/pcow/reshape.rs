//! Changes to the super cluster and the image as a whole (docs/pcow-format.md, "Resizing,
//! rebasing, emptying"): resize, a new base image, and emptying the image for `vdisk commit`.
//!
//! The super cluster's fields and its checksum all lie in its first 128 bytes, which are
//! written in one write inside the first sector: a crash leaves the old fields or the new ones,
//! never a mix (the crash model of "Writing: the durability order"). A long base name (over 48
//! bytes) lies after them: a new one is written and synced before the 128 bytes that make it
//! count, where nothing reads it yet; one long name cannot be replaced by another, since the
//! checksum of the old fields covers the bytes the new name would overwrite.

use super::create::CreateOptions;
use super::layout::{Base, Super, CUR_SEGMENT_NUM_AT};
use super::Pcow;
use crate::blockdev::BlockDev;
use crate::error::{Error, IoContext, Result};
use crate::formats::Preallocation;

/// The super cluster's fixed fields, checksum included; a long base name starts here.
const FIXED: usize = 128;
/// Base names up to this long live in the fixed fields.
const SHORT_NAME: usize = 48;

fn long_name(sb: &Super) -> Option<&str> {
    sb.base
        .as_ref()
        .map(|b| b.name.as_str())
        .filter(|n| n.len() > SHORT_NAME)
}

impl Pcow {
    /// Sets the disk's size. Growing is one write of the super cluster; shrinking only when
    /// no data of this image lies at or past the new end (nothing is dropped), and growing
    /// only when the base image reads nothing past the old end (the new area must read zeroes).
    pub(super) fn resize_to(&mut self, size: u64, prealloc: Preallocation) -> Result<()> {
        self.writable("resize")?;
        if prealloc != Preallocation::Off {
            return Err(Error::unsupported(
                "pcow images are thin-provisioned: resize takes no preallocation",
            ));
        }
        let old = self.size();
        let cs = self.cluster();
        if size % 512 != 0 {
            return Err(Error::invalid("The new size must be a multiple of 512"));
        }
        if size < old {
            let st = self.state();
            let first = size / cs;
            let kept = st.parts.iter().flat_map(|p| p.entries.keys());
            if let Some(n) = kept.filter(|&&n| u64::from(n) >= first).min() {
                return Err(Error::unsupported(format!(
                    "pcow: cannot shrink to {size} bytes: cluster {n} at {:#x} holds data \
                     (a pcow image shrinks only where it holds nothing; convert it to a \
                     smaller image instead)",
                    u64::from(*n) * cs
                )));
            }
        }
        let below = self.backing.as_ref().map_or(0, |b| b.size());
        if size > old && below > old {
            return Err(Error::unsupported(format!(
                "pcow: cannot grow over a base image of {below} bytes, longer than the image's \
                 {old}: the new area would read the base image's data instead of zeroes"
            )));
        }
        let sb = self.super_with(size, self.sb.base.clone())?;
        self.write_super(sb)
    }

    /// Names another base image (or none) in the super cluster; the data is not touched.
    pub(super) fn rebase_to(&mut self, name: Option<&str>, format: Option<&str>) -> Result<()> {
        self.writable("change the backing file")?;
        let base = name.map(|n| Base {
            name: n.to_string(),
            format: format.map(str::to_string),
        });
        let sb = self.super_with(self.size(), base)?;
        if let (Some(old), Some(new)) = (long_name(&self.sb), long_name(&sb)) {
            if old != new {
                return Err(Error::unsupported(format!(
                    "pcow: a base name of more than {SHORT_NAME} bytes cannot be replaced by \
                     another one in one atomic write; rebase to a shorter name (or none) first"
                )));
            }
        }
        self.write_super(sb)
    }

    /// Drops every entry, so that the whole disk reads from the base image again (after
    /// `vdisk commit` copied the data there): cur_segment_num 0, one aligned store, synced;
    /// then the file is cut after the super cluster.
    pub(super) fn empty(&mut self) -> Result<()> {
        self.writable("empty the image")?;
        if self.state().snapshot_clusters().next().is_some() {
            return Err(Error::unsupported(
                "pcow: an image with snapshots cannot be emptied (the snapshots' data would \
                 still show through where the writable part held none)",
            ));
        }
        let s = &*self.storage;
        s.write_at(CUR_SEGMENT_NUM_AT, &0u32.to_le_bytes())
            .context(|| "writing cur_segment_num".into())?;
        s.sync().context(|| "syncing cur_segment_num".into())?;
        let cs = self.cluster();
        if !s.fixed_size() {
            s.set_len(cs)
                .context(|| format!("cutting the emptied image at {cs:#x}"))?;
        }
        self.reload()
    }

    /// The super cluster with a new size and base, checked as `create` checks them.
    fn super_with(&self, size: u64, base: Option<Base>) -> Result<Super> {
        let o = CreateOptions {
            size,
            cluster_size: self.cluster(),
            base,
        };
        Ok(Super {
            image_id: self.sb.image_id,
            ..o.superblock()?
        })
    }

    /// Writes `sb` (see the module docs for the order), after a flush, so that no write is
    /// left whose metadata would be committed with the old geometry.
    fn write_super(&mut self, mut sb: Super) -> Result<()> {
        self.commit()?;
        sb.segments = self.state().committed_segments;
        let bytes = sb.encode();
        let s = &*self.storage;
        let old_long = long_name(&self.sb).map(str::len);
        if bytes.len() > FIXED && old_long.is_none() {
            s.write_at(FIXED as u64, &bytes[FIXED..])
                .context(|| "writing the long base name".into())?;
            s.sync().context(|| "syncing the long base name".into())?;
        }
        s.write_at(0, &bytes[..FIXED])
            .context(|| "writing the pcow super cluster".into())?;
        s.sync()
            .context(|| "syncing the pcow super cluster".into())?;
        if let (Some(len), None) = (old_long, long_name(&sb)) {
            // No longer covered by the checksum; zeroed as the format wants the rest of the
            // cluster, a failure here leaves a sound image.
            let _ = s.write_at(FIXED as u64, &vec![0u8; len]);
        }
        self.state.get_mut().unwrap_or_else(|e| e.into_inner()).geo = sb.geo;
        self.sb = sb;
        Ok(())
    }
}
