//! `vdisk snapshot`: internal snapshots, as `qemu-img snapshot` handles them. Listing works on
//! any image; creating, applying and deleting need the qcow2 write path.

use std::process::ExitCode;

use vdisk::open_image;

use crate::{fail, info, read_options};

pub fn run(filename: &str, format: Option<&str>, list: bool) -> ExitCode {
    if !list {
        return fail("only listing snapshots (-l) is supported yet", 1);
    }
    let image = match read_options(format).and_then(|o| open_image(filename, &o)) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    let snapshots = image.qcow2().map(|q| q.snapshots()).unwrap_or_default();
    print!("{}", info::snapshot_list(snapshots));
    ExitCode::SUCCESS
}
