//! Formats stacked in one file: an image whose storage is the disk of a data layout (qcow2 on
//! seqlog: `vdisk create -f qcow2 -o data_layout=seqlog`). The layout's header records the
//! format it holds, so nothing is guessed from the disk's bytes (which a guest of a plain
//! layout disk writes). A file probed as the layout, or named as the format it holds, opens
//! as that image over the layout; named as the layout itself (`-f seqlog`), it opens as the
//! layout alone, whose disk holds the image's bytes.
//!
//! ```text
//!   file ─► layout (seqlog: its disk grows as the image's file does) ─► DiskStorage ─► image
//! ```

use std::sync::Arc;

use super::driver::Driver;
use super::entry::Opener;
use super::info::{CheckFailed, Fix, Messages, RepairReport};
use super::registry::{layout_of, Format};
use crate::blockdev::BlockDev;
use crate::error::{Error, Result};
use crate::storage::{DiskStorage, Storage};

/// The data layout under an image: its format and its open disk.
#[derive(Clone)]
pub struct Layout {
    pub format: Format,
    pub driver: Arc<dyn Driver>,
}

impl Layout {
    /// The layout's disk as the storage of the image it holds.
    pub fn storage(&self) -> Arc<dyn Storage> {
        let disk: Arc<dyn BlockDev> = self.driver.clone();
        Arc::new(DiskStorage::new(disk))
    }
}

/// An image's driver, the format it is of, and the layout under it, if any.
pub(crate) struct Opened {
    pub format: Format,
    pub driver: Box<dyn Driver>,
    pub layout: Option<Layout>,
}

/// Opens the image in `storage` as `format` (probed from its bytes, or named), over the layout
/// the file is where it is one that holds an image (see the module docs).
pub(crate) fn open(
    format: Format,
    probed: bool,
    storage: Arc<dyn Storage>,
    cx: &mut dyn Opener,
) -> Result<Opened> {
    // Named as a layout, or probed as anything else: no layout to look for.
    let maybe = !format.is_protocol() && probed == format.entry().holds.is_some();
    let stacked = match maybe.then(|| layout_of(&*storage)).transpose()?.flatten() {
        Some((layout, held)) if format == layout || format == held => Some((layout, held)),
        _ => None,
    };
    let Some((layout, held)) = stacked else {
        let driver = (format.entry().open)(storage, cx)?;
        return Ok(Opened {
            format,
            driver,
            layout: None,
        });
    };
    let layout = Layout {
        format: layout,
        driver: Arc::from((layout.entry().open)(storage, cx)?),
    };
    let driver = (held.entry().open)(layout.storage(), cx)?;
    Ok(Opened {
        format: held,
        driver,
        layout: Some(layout),
    })
}

/// Opens the layout in `file` alone (to make or repair the image it holds), if `file` is one.
pub fn open_layout(file: Arc<dyn Storage>, write: bool) -> Result<Option<(Layout, Format)>> {
    let Some((format, held)) = layout_of(&*file)? else {
        return Ok(None);
    };
    let driver = (format.entry().open)(file, &mut Alone(write))?;
    let layout = Layout {
        format,
        driver: Arc::from(driver),
    };
    Ok(Some((layout, held)))
}

/// Repairs the image of `format` in `file` (`vdisk check -r`), through the layout under it
/// where the file is one holding it.
pub fn repair(
    format: Format,
    file: &Arc<dyn Storage>,
    fix: Fix,
    say: Messages,
) -> std::result::Result<RepairReport, Box<CheckFailed>> {
    let failed = Box::<CheckFailed>::from;
    let opened = open_layout(file.clone(), true).map_err(failed)?;
    let Some((layout, _)) = opened.filter(|(_, held)| *held == format) else {
        return format.repair(file, fix, say);
    };
    let report = format.repair(&layout.storage(), fix, say)?;
    layout.driver.close().map_err(failed)?;
    Ok(report)
}

/// What a layout opened alone is asked by its format's open function: it names no files.
struct Alone(bool);

impl Opener for Alone {
    fn write(&self) -> bool {
        self.0
    }

    fn check(&self) -> bool {
        false
    }

    fn say(&mut self, _message: String) {}

    fn open_backing(&mut self, _: &str, _: Option<&str>) -> Result<Option<Arc<dyn BlockDev>>> {
        Ok(None)
    }

    fn open_data_file(&mut self, _: Option<&str>) -> Result<Arc<dyn Storage>> {
        Err(Error::unsupported(
            "a data layout has no external data file",
        ))
    }
}
