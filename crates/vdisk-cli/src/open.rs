//! The image options a subcommand's `-f` and `-U` select for opening an image.

use vdisk::{Format, ImageOptions};

/// The format `-f` names for opening `filename`; an unknown one fails as QEMU's open does.
pub fn image_format(filename: &str, format: Option<&str>) -> vdisk::Result<Option<Format>> {
    format
        .map(Format::parse)
        .transpose()
        .map_err(|e| e.prefixed(&format!("Could not open '{filename}': ")))
}

/// Image options for a read-only open of `filename` with an optional `-f`, without locks if
/// `force_share` (`-U`).
pub fn read_options(
    filename: &str,
    format: Option<&str>,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        format: image_format(filename, format)?,
        force_share,
        ..ImageOptions::default()
    })
}

/// Image options for commands that read metadata only (info, map, check, snapshot -l).
pub fn metadata_options(
    filename: &str,
    format: Option<&str>,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        metadata_only: true,
        ..read_options(filename, format, force_share)?
    })
}
