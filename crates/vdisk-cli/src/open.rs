//! The image options a subcommand's `-f`, `--image-opts` and `-U` select for opening an
//! image. What the name itself means (a path, `nbd://`, `json:{...}`, option strings) is read
//! by the engine's one parser ([`vdisk::spec`]), for every subcommand alike.

use vdisk::{Error, Format, ImageOptions};

use crate::flags::ImageFormat;

/// The format `-f` names for opening `filename`; an unknown one fails as QEMU's open does.
pub fn image_format(filename: &str, format: Option<&str>) -> vdisk::Result<Option<Format>> {
    format
        .map(Format::parse)
        .transpose()
        .map_err(|e| e.prefixed(&format!("Could not open '{filename}': ")))
}

/// Image options for opening `filename` as `-f` and `--image-opts` say; QEMU refuses the two
/// together.
pub fn image_options(filename: &str, image: &ImageFormat) -> vdisk::Result<ImageOptions> {
    if image.image_opts && image.format.is_some() {
        return Err(Error::invalid(
            "--image-opts and --format are mutually exclusive",
        ));
    }
    Ok(ImageOptions {
        format: image_format(filename, image.format.as_deref())?,
        image_opts: image.image_opts,
        ..ImageOptions::default()
    })
}

/// Image options for a read-only open of `filename`, without locks if `force_share` (`-U`).
pub fn read_options(
    filename: &str,
    image: &ImageFormat,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        force_share,
        ..image_options(filename, image)?
    })
}

/// Image options for commands that read metadata only (info, map, check, snapshot -l).
pub fn metadata_options(
    filename: &str,
    image: &ImageFormat,
    force_share: bool,
) -> vdisk::Result<ImageOptions> {
    Ok(ImageOptions {
        metadata_only: true,
        ..read_options(filename, image, force_share)?
    })
}
