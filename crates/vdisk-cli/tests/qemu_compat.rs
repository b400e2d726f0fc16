//! End-to-end compatibility of `vdisk` with QEMU's `qemu-img` (10.x).
//!
//! Every image here is made by QEMU itself (`qemu-img create`, `qemu-io`, `qemu-img convert -c`,
//! `qemu-img snapshot`), or by QEMU and then damaged in place. For each image the suite runs the
//! same command with `qemu-img` and with `vdisk` in the same directory and requires the same
//! result: `convert -O raw` (also `-l SNAPSHOT`) byte for byte; `map` (JSON and human) text;
//! `info` (JSON keys, whole JSON text, human text); `check` (human and JSON: stdout, stderr lines
//! modulo the `qemu-img: `/`vdisk: ` prefix, exit status); `compare` against the converted raw
//! image, as is and after changing a byte.
//!
//! QEMU's answer is the reference: a test failing here means vdisk differs from QEMU. Each test
//! is one family of images; all discrepancies of a family are collected and reported together,
//! each tagged with the image name and the two commands. Without `qemu-img`/`qemu-io` the tests
//! skip, unless `CI=true`, where they fail. `QEMU_COMPAT_KEEP=1` keeps the scratch directories.
//!
//! | file               | what it holds                                                           |
//! |--------------------|-------------------------------------------------------------------------|
//! | `compare.rs`       | one image under comparison, and every comparison run on it              |
//! | `make.rs`          | building images with QEMU's tools                                       |
//! | `clusters.rs`      | cluster sizes, versions, refcount widths, zero, compressed, extended L2 |
//! | `preallocation.rs` | preallocated qcow2 images, raw images                                   |
//! | `chains.rs`        | backing chains, external data files                                     |
//! | `snapshots.rs`     | internal snapshots, persistent dirty bitmaps                            |
//! | `damaged.rs`       | truncated and damaged images: `check` and `check -r`                    |
//! | `corruption.rs`    | corruption events while reading and writing, the corrupt bit            |

mod common;

#[path = "qemu_compat/chains.rs"]
mod chains;
#[path = "qemu_compat/clusters.rs"]
mod clusters;
#[path = "qemu_compat/compare.rs"]
mod compare;
#[path = "qemu_compat/corruption.rs"]
mod corruption;
#[path = "qemu_compat/damaged.rs"]
mod damaged;
#[path = "qemu_compat/make.rs"]
mod make;
#[path = "qemu_compat/preallocation.rs"]
mod preallocation;
#[path = "qemu_compat/snapshots.rs"]
mod snapshots;
