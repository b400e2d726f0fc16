//! Building images with QEMU's tools.

use crate::common::{Qcow2Edit, Workdir};

/// `qemu-img create -f qcow2 [-o OPTS] PATH SIZE`.
pub(crate) fn create(wd: &Workdir, path: &str, opts: &str, size: &str) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([path, size]);
    wd.setup_img(&args);
}

/// `qemu-img create -f qcow2 -b BACKING -F FMT [-o OPTS] PATH [SIZE]`; BACKING is relative to
/// PATH's directory, as stored in the header.
pub(crate) fn overlay(
    wd: &Workdir,
    path: &str,
    backing: &str,
    fmt: &str,
    opts: &str,
    size: Option<&str>,
) {
    let mut args = vec!["create", "-q", "-f", "qcow2", "-b", backing, "-F", fmt];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.push(path);
    args.extend(size);
    wd.setup_img(&args);
}

/// `qemu-img create -f raw [-o preallocation=P] PATH SIZE`.
pub(crate) fn create_raw(wd: &Workdir, path: &str, prealloc: &str, size: &str) {
    let opt = format!("preallocation={prealloc}");
    let mut args = vec!["create", "-q", "-f", "raw"];
    if !prealloc.is_empty() {
        args.extend(["-o", &opt]);
    }
    args.extend([path, size]);
    wd.setup_img(&args);
}

pub(crate) fn io(wd: &Workdir, path: &str, cmds: &[&str]) {
    wd.setup_io(path, None, cmds);
}

pub(crate) fn io_raw(wd: &Workdir, path: &str, cmds: &[&str]) {
    wd.setup_io(path, Some("raw"), cmds);
}

pub(crate) fn snapshot(wd: &Workdir, path: &str, name: &str) {
    wd.setup_img(&["snapshot", "-c", name, path]);
}

/// `qemu-img convert -c -O qcow2 [-o OPTS] SRC DST`.
pub(crate) fn compress(wd: &Workdir, src: &str, dst: &str, opts: &str) {
    let mut args = vec!["convert", "-c", "-f", "raw", "-O", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([src, dst]);
    wd.setup_img(&args);
}

pub(crate) fn edit(wd: &Workdir, path: &str) -> Qcow2Edit {
    Qcow2Edit::open(&wd.abs(path))
}
