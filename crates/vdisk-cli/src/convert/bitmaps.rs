//! `convert --bitmaps [--skip-broken-bitmaps]`: the source's persistent bitmaps copied into the
//! target after its data, as qemu-img copies them (each added with the source's granularity,
//! disabled where the source's is, then merged from it), with its checks and words.

use vdisk::formats::{BitmapAction, BitmapInfo};
use vdisk::{Error, Image};

use crate::report::message;

/// The source's bitmaps in the order QEMU visits them: the newest first, which for bitmaps
/// read from an image is the directory's last.
fn bitmaps(source: &Image) -> Vec<BitmapInfo> {
    let mut all = source.driver().bitmaps().unwrap_or_default();
    all.reverse();
    all
}

/// Before the target is made: the one source can give its bitmaps, and none is in use unless
/// `skip_broken`.
pub(super) fn check(sources: &[Image], skip_broken: bool) -> vdisk::Result<()> {
    let [source] = sources else {
        return Err(Error::invalid(
            "Copying bitmaps only possible with single source",
        ));
    };
    if source.driver().bitmaps().is_none() {
        return Err(Error::unsupported("Source lacks bitmap support"));
    }
    match bitmaps(source).iter().find(|b| b.in_use && !skip_broken) {
        Some(b) => Err(Error::invalid(format!(
            "Cannot copy inconsistent bitmap '{}'\nTry --skip-broken-bitmaps, or use \
             'qemu-img bitmap --remove' to delete it",
            b.name
        ))),
        None => Ok(()),
    }
}

/// Once the target is open: it must be able to hold bitmaps.
pub(super) fn check_target(target: &Image) -> vdisk::Result<()> {
    match target.driver().bitmaps() {
        Some(_) => Ok(()),
        None => Err(Error::unsupported(format!(
            "Format driver '{}' does not support bitmaps",
            target.format().name()
        ))),
    }
}

/// After the data: each bitmap added to the target and filled from the source's.
pub(super) fn copy(source: &Image, target: &mut Image, skip_broken: bool) -> vdisk::Result<()> {
    for b in bitmaps(source) {
        if b.in_use && skip_broken {
            message(format!(
                "warning: Skipping inconsistent bitmap '{}'",
                b.name
            ));
            continue;
        }
        let add = BitmapAction::Add {
            granularity: Some(b.granularity as u32),
            disabled: !b.auto,
        };
        let d = target.driver_mut();
        d.bitmap(&b.name, add)
            .map_err(|e| e.prefixed(&format!("Failed to create bitmap {}: ", b.name)))?;
        let bits = source.driver().bitmap_copy(&b.name);
        let merge = BitmapAction::Merge {
            source: &b.name,
            bits,
        };
        if let Err(e) = d.bitmap(&b.name, merge) {
            let _ = d.bitmap(&b.name, BitmapAction::Remove);
            return Err(e.prefixed(&format!("Failed to populate bitmap {}: ", b.name)));
        }
    }
    Ok(())
}
