//! The `vdisk` binary on hostile files: every subcommand must end, within a deadline, with the
//! exit status qemu-img gives (1 for an image that cannot be opened or read, 2 for `compare`
//! open errors, 2 for `check` corruptions) and one clear line on stderr, never a panic.
//!
//! The images are written by hand here (a 512-byte-cluster qcow2 writer, a few dozen lines);
//! tests that also want QEMU's own images skip when `qemu-img` is missing, except under
//! `CI=true`, where they fail.
//!
//! | file            | what it holds                                                     |
//! |-----------------|-------------------------------------------------------------------|
//! | `run.rs`        | running the binary under a deadline, and what it must answer      |
//! | `writer.rs`     | the qcow2 writer, and qemu-img for the images QEMU makes          |
//! | `headers.rs`    | what a header claims: garbage, truncation, huge sizes, L2 offsets |
//! | `chains.rs`     | backing chains: loops, missing files, files that are not regular  |
//! | `compressed.rs` | compressed clusters: garbage, zstd windows under a memory limit   |

#[path = "hostile_cli/chains.rs"]
mod chains;
#[path = "hostile_cli/compressed.rs"]
mod compressed;
#[path = "hostile_cli/headers.rs"]
mod headers;
#[path = "hostile_cli/run.rs"]
mod run;
#[path = "hostile_cli/writer.rs"]
mod writer;
