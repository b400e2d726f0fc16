//! Corrupt and hostile qcow2 images: opening one must fail with a clear error, or succeed and then
//! every read, block status and check over the disk must return (Ok or Err) without panicking,
//! hanging, or allocating more memory than the file justifies.
//!
//! A small qcow2 writer that shares no code with the crate builds valid images (v2 and v3, every
//! refcount width, zero, preallocated-zero and compressed clusters, extended L2 entries with
//! partial subcluster bitmaps, a snapshot, a backing file name); proptest then damages them (byte
//! flips, header fields and table entries overwritten with values chosen to hurt, truncation).
//! A counting global allocator measures each case's peak heap use, and each case runs on its own
//! thread under a deadline so a hang fails the test instead of stalling it.
//!
//! Undamaged images must also read back exactly what was written and check clean, which keeps
//! the writer honest; `builder_images_pass_qemu_img_check` has QEMU vouch for it too.
//!
//! Each proptest case then writes to the image (`hostile_images/writes.rs`): a short sequence of
//! writes, zeroes, discards, flushes, reads and snapshots on a copy opened for writing, a close,
//! a second writable open, a repair and reads again, under the same deadline and a larger heap
//! budget. On undamaged images the disk must then hold exactly what a flat model of it says,
//! and check clean after the close. On images whose refcounts call their own metadata free
//! (`hostile_images/refcounts.rs`), no write may cost guest data it did not touch.
//!
//! | file               | what it holds                                                      |
//! |--------------------|--------------------------------------------------------------------|
//! | `heap.rs`          | the counting allocator: the peak heap of a case, and its budget    |
//! | `builder.rs`       | the minimal qcow2 writer, and the images proptest asks it for      |
//! | `damage.rs`        | damage: byte flips, header fields, table entries, truncation       |
//! | `drive.rs`         | a case: every read-path entry point, under a deadline and a budget |
//! | `sweeps.rs`        | proptest over valid and damaged images, truncations, random bytes  |
//! | `tables.rs`        | explicit cases: header fields, table sizes, snapshot tables        |
//! | `clusters.rs`      | explicit cases: compressed clusters, extended L2 bitmaps           |
//! | `check.rs`         | explicit cases: what check costs on shared or missing tables       |
//! | `qemu.rs`          | QEMU vouches for the writer                                        |
//! | `writes.rs`        | the write phase of a case, and the flat model it is held to        |
//! | `writes/cases.rs`  | explicit cases of the write phase                                  |
//! | `writes/sparse.rs` | the sparse file in memory the write phase writes to                |
//! | `refcounts.rs`     | refcounts calling metadata free: no write costs untouched data     |

#[path = "hostile_images/builder.rs"]
mod builder;
#[path = "hostile_images/check.rs"]
mod check;
#[path = "hostile_images/clusters.rs"]
mod clusters;
#[path = "hostile_images/damage.rs"]
mod damage;
#[path = "hostile_images/drive.rs"]
mod drive;
#[path = "hostile_images/heap.rs"]
mod heap;
#[path = "hostile_images/qemu.rs"]
mod qemu;
#[path = "hostile_images/refcounts.rs"]
mod refcounts;
#[path = "hostile_images/sweeps.rs"]
mod sweeps;
#[path = "hostile_images/tables.rs"]
mod tables;
#[path = "hostile_images/writes.rs"]
mod writes;
