//! Helpers shared by the tests that hold `vdisk` against QEMU's own tools: finding `qemu-img`
//! and `qemu-io` (and the CI rule for when they are missing), running commands in a scratch
//! directory, collecting discrepancies into one readable report, and editing qcow2 metadata in
//! place to build damaged images.
//!
//! | file            | what it holds                                                           |
//! |-----------------|-------------------------------------------------------------------------|
//! | `tools.rs`      | finding `qemu-img` and `qemu-io`, and skipping without them (not in CI) |
//! | `workdir.rs`    | the scratch directory commands run in, and what one command did         |
//! | `report.rs`     | discrepancies collected over a family of images, line diffs             |
//! | `content.rs`    | deterministic guest contents: random bytes, mixed compressible data     |
//! | `qcow2_edit.rs` | editing qcow2 metadata in place, for damaged images                     |

#![allow(dead_code)] // every test crate that includes this module uses a different subset

mod content;
mod qcow2_edit;
mod report;
mod tools;
mod workdir;

// Each test crate uses a different subset of these, too.
#[allow(unused_imports)]
pub use self::{
    content::{mixed_content, random_bytes},
    qcow2_edit::{Qcow2Edit, COMPRESSED, COPIED, OFFSET_MASK, ZERO},
    report::{line_diff, Failures},
    tools::{tools, under_ci, Tools},
    workdir::{Outcome, Workdir},
};
