//! The source images of `vdisk convert`, read as one disk.

use vdisk::{open_image, BlockDev, Error, Image, ImageOptions};

use super::Args;
use crate::open::read_options;
use crate::options::snapshot_param;
use crate::rebase::status_span;

/// The source images read as one disk, each after the one before it.
pub(super) struct Sources {
    pub(super) images: Vec<Image>,
    /// Where each image starts in the whole.
    starts: Vec<u64>,
    size: u64,
}

impl Sources {
    pub(super) fn open(args: &Args) -> vdisk::Result<Sources> {
        let mut images = Vec::with_capacity(args.sources().len());
        for name in args.sources() {
            let opts = read_options(name, &args.source_naming(), args.share.force_share)?;
            let opts = ImageOptions {
                direct: args.direct_source(),
                ..opts
            };
            images.push(open_image(name, &opts)?);
        }
        if let Some(param) = args.snapshot.as_deref() {
            if images.len() > 1 {
                return Err(Error::unsupported(
                    "No support for concatenating multiple snapshot",
                ));
            }
            let image = &mut images[0];
            snapshot_param(image, param).and_then(|p| image.driver_mut().load_snapshot(&p))?;
        }
        let mut starts = Vec::with_capacity(images.len());
        let mut size = 0u64;
        for image in &images {
            starts.push(size);
            size = size
                .checked_add(image.size())
                .ok_or_else(|| Error::invalid("The sources are too large together"))?;
        }
        Ok(Sources {
            images,
            starts,
            size,
        })
    }

    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// The image that holds byte `pos` of the whole, the offset in it and its bytes from there.
    fn locate(&self, pos: u64) -> (&Image, u64, u64) {
        let i = self.starts.partition_point(|&s| s <= pos) - 1;
        let image = &self.images[i];
        let at = pos - self.starts[i];
        (image, at, image.size() - at)
    }

    /// The image holding byte `pos` as qemu-img's status walk sees it: where it starts in the
    /// whole, the alignment its runs keep (its cluster size, else a sector), and how far one
    /// of QEMU's extents may reach in it (a cached slice of a qcow2 L2 table; a raw image's
    /// may reach its end).
    pub(super) fn part(&self, pos: u64) -> (u64, u64, u64) {
        let (image, at, _) = self.locate(pos);
        let driver = image.driver();
        let (align, span) = match (driver.cluster_size(), driver.subcluster_size()) {
            (Some(c), Some(sc)) => (c, status_span(c, sc, image.size())),
            (Some(c), None) => (c, u64::MAX),
            _ => (512, u64::MAX),
        };
        (pos - at, align, span)
    }

    /// Block status of `[pos, pos + len)`, which ends at the end of the image it starts in.
    pub(super) fn block_status(&self, pos: u64, len: u64) -> vdisk::Result<vdisk::BlockStatus> {
        let (image, at, left) = self.locate(pos);
        image.block_status(at, len.min(left))
    }

    pub(super) fn read(&self, pos: u64, buf: &mut [u8]) -> vdisk::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let (image, at, left) = self.locate(pos + done as u64);
            let n = (buf.len() - done).min(left as usize);
            image.read(at, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }
}

/// Whether `target` is a file the source (or its backing chain) reads: writing it would
/// destroy what is being copied.
pub(super) fn reads_from(source: &Image, target: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(t) = std::fs::metadata(target) else {
        return false;
    };
    let mut layer = Some(source);
    while let Some(image) = layer {
        if std::fs::metadata(&image.filename)
            .is_ok_and(|m| (m.dev(), m.ino()) == (t.dev(), t.ino()))
        {
            return true;
        }
        layer = image.backing().map(|b| &**b);
    }
    false
}
