//! QEMU's ways of naming an image, held against qemu-img 10 on the same input (issue 27:
//! iotests 020, 089, 110, 150, 162 and the `--image-opts` ones name images so): `json:{...}`
//! file names (nested and flattened options, `backing` overrides, single-quoted strings),
//! `--image-opts` option strings, the `file:` prefix, `null-co://`, and NBD exports named by
//! URL or options (served by qemu-nbd). Each command runs in both tools; output, messages and
//! exit status must match, and for commands that write, the images they leave.
//!
//! | file                    | what it holds                                                |
//! |-------------------------|--------------------------------------------------------------|
//! | `image_names/read.rs`   | json: and option names read, refused names, null-co, direct  |
//! | `image_names/nbd.rs`    | NBD exports of qemu-nbd read and written, `serve` of names   |
//! | `image_names/writes.rs` | commands that write through option names, `data-file`        |

mod common;

#[path = "image_names/nbd.rs"]
mod nbd;
#[path = "image_names/read.rs"]
mod read;
#[path = "image_names/writes.rs"]
mod writes;

use common::{Failures, Workdir};

/// Runs `args` in both tools and compares everything they print.
pub fn same(f: &mut Failures, wd: &Workdir, what: &str, args: &[&str]) {
    let (q, v) = (wd.qemu_img(args), wd.vdisk(args));
    f.same_outcome(what, &args.join(" "), &q, &v);
}

/// A base image with data and an overlay with more, both qcow2.
pub fn chain(wd: &Workdir, base: &str, top: &str) {
    wd.setup_img(&["create", "-q", "-f", "qcow2", base, "1M"]);
    wd.setup_io(base, None, &["write -P 1 0 128k", "write -z 512k 64k"]);
    wd.setup_img(&[
        "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top,
    ]);
    wd.setup_io(top, None, &["write -P 2 64k 128k"]);
}
