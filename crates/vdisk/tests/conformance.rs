//! The `BlockDev` conformance suite: one body of tests, written once against `&dyn BlockDev`,
//! that every format and every stacking runs (STYLE.md point 8).
//!
//! A subject is a name and a factory ([`subject::Subject`]); the list below stamps one
//! `#[test]` per subject and test body, named `subject::body`, so a failure names both and
//! `cargo test --test conformance qcow2_512` or `... crash` runs one row or one column.
//! Adding a subject is one line in the `subjects!` list at the end; adding a body is one line
//! in the list of bodies inside `subjects!`.
//!
//! | file            | what it checks                                                          |
//! |-----------------|-------------------------------------------------------------------------|
//! | `io.rs`         | fresh reads, writes of every size class, out-of-range requests          |
//! | `zeroes.rs`     | write_zeroes, write_zeroes_fast, discard                                |
//! | `status.rs`     | block_status against reads, the chain and what was written              |
//! | `started.rs`    | start_write / finish_write / start_read, failed outcomes                |
//! | `durability.rs` | flush and FUA, close / drop / reopen, concurrent writers                |
//! | `crash.rs`      | every crash state of two workloads (CrashStorage, torn writes in one)   |
//! | `fault.rs`      | EIO, ENOSPC, short writes on every storage of the disk (FaultStorage)   |
//!
//! Around them: `subject.rs` (the subjects and the [`subject::Disk`] they open as; pcow's in
//! `subject_pcow.rs`, seqlog's with alternating streams in `subject_streams.rs`),
//! `model.rs` (the byte model and the data written), `workload.rs` (requests of every size
//! class), `history.rs` (what a disk may hold after a crash or a failure).
//!
//! The crash and fault sweeps run on in-memory copies of a subject's storages (a file-backed
//! subject's too), since every case needs fresh storages.
//!
//! `CONFORMANCE_CASES=n` (default 1), for a soak: n times the crash and fault workloads per
//! subject, each with up to n times more crash states checked and more fault points.

#[path = "conformance/crash.rs"]
mod crash;
#[path = "conformance/durability.rs"]
mod durability;
#[path = "conformance/fault.rs"]
mod fault;
#[path = "conformance/history.rs"]
mod history;
#[path = "conformance/io.rs"]
mod io;
#[path = "conformance/model.rs"]
mod model;
#[path = "conformance/started.rs"]
mod started;
#[path = "conformance/status.rs"]
mod status;
#[path = "conformance/subject.rs"]
mod subject;
#[macro_use]
#[path = "conformance/suite.rs"]
mod suite;
#[path = "conformance/workload.rs"]
mod workload;
#[path = "conformance/zeroes.rs"]
mod zeroes;

use vdisk::formats::qcow2::create::CreateOptions;
use vdisk::formats::seqlog::Policy;

/// The size of the disks the tests ask for; a subject makes at least four of its clusters.
const MIN_SIZE: u64 = 1 << 20;

/// `..CreateOptions::default()` with the given fields.
macro_rules! qcow2_opts {
    ($($field:ident: $value:expr),* $(,)?) => {
        CreateOptions { $($field: $value,)* ..CreateOptions::default() }
    };
}

/// seqlog's `CreateOptions` with the given fields. The subjects choose small segments, so
/// that a small disk has many and the workloads here make the cleaner run.
macro_rules! seqlog_opts {
    ($($field:ident: $value:expr),* $(,)?) => {
        vdisk::formats::seqlog::CreateOptions {
            $($field: $value,)*
            ..Default::default()
        }
    };
}

subjects! {
    raw_memory => raw("raw on memory", Backend::Memory);
    raw_file => raw("raw on a file", Backend::File);
    qcow2_64k => qcow2("qcow2", qcow2_opts!());
    qcow2_512 => qcow2("qcow2 512 B clusters", qcow2_opts!(cluster_size: 512));
    qcow2_2m => qcow2("qcow2 2 MiB clusters", qcow2_opts!(cluster_size: 2 << 20));
    qcow2_extended_l2 => qcow2("qcow2 extended_l2", qcow2_opts!(extended_l2: true));
    qcow2_v2 => qcow2("qcow2 compat=0.10", qcow2_opts!(version: 2));
    qcow2_lazy_refcounts => qcow2("qcow2 lazy_refcounts", qcow2_opts!(lazy_refcounts: true));
    qcow2_refcount_bits_1 => qcow2("qcow2 refcount_bits=1", qcow2_opts!(refcount_bits: 1));
    qcow2_refcount_bits_64 => qcow2("qcow2 refcount_bits=64", qcow2_opts!(refcount_bits: 64));
    qcow2_over_raw => qcow2_over_raw("qcow2 over raw", qcow2_opts!());
    qcow2_v2_over_raw => qcow2_over_raw("qcow2 compat=0.10 over raw", qcow2_opts!(version: 2));
    qcow2_extended_l2_over_raw =>
        qcow2_over_raw("qcow2 extended_l2 over raw", qcow2_opts!(extended_l2: true));
    qcow2_over_qcow2_over_raw => qcow2_over_qcow2_over_raw("qcow2 over qcow2 over raw");
    qcow2_data_file => qcow2_data_file("qcow2 with a data file", false);
    qcow2_data_file_raw => qcow2_data_file("qcow2 with a raw data file", true);
    qcow2_on_raw_file => qcow2_on_raw("qcow2 on raw-as-storage on a file", Backend::File);
    seqlog_memory => seqlog("seqlog", seqlog_opts!(segment_size: 64 << 10), Backend::Memory, false);
    seqlog_file =>
        seqlog("seqlog on a file", seqlog_opts!(segment_size: 64 << 10), Backend::File, false);
    seqlog_512 => seqlog(
        "seqlog 512 B blocks",
        seqlog_opts!(block_size: 512, segment_size: 64 << 10),
        Backend::Memory,
        false
    );
    seqlog_filled => seqlog(
        "seqlog filled, 4 KiB segments of 512 B blocks",
        seqlog_opts!(block_size: 512, segment_size: 4096, spare: 25),
        Backend::Memory,
        true
    );
    seqlog_filled_greedy => seqlog(
        "seqlog filled, greedy cleaner, 10% spare",
        seqlog_opts!(segment_size: 64 << 10, spare: 10, policy: Policy::Greedy),
        Backend::Memory,
        true
    );
    seqlog_alternating => seqlog_alternating(
        "seqlog, writes alternating between its streams",
        seqlog_opts!(segment_size: 64 << 10),
        Backend::Memory,
        false
    );
    seqlog_alternating_filled => seqlog_alternating(
        "seqlog filled, writes alternating between its streams, 4 KiB segments of 512 B blocks",
        seqlog_opts!(block_size: 512, segment_size: 4096, spare: 25),
        Backend::Memory,
        true
    );
    // Pages of 128 entries (512 B blocks), two of them in memory: nearly every page is written
    // out and read back, from the newest checkpoint's slot or the next one's.
    seqlog_map_capped => seqlog(
        "seqlog, map memory capped at two pages",
        seqlog_opts!(block_size: 512, segment_size: 64 << 10, map_memory: 1024),
        Backend::Memory,
        false
    );
    seqlog_map_capped_filled => seqlog(
        "seqlog filled, map memory capped at two pages",
        seqlog_opts!(block_size: 512, segment_size: 4096, spare: 25, map_memory: 1024),
        Backend::Memory,
        true
    );
    qcow2_on_seqlog_memory => qcow2_on_seqlog(
        "qcow2 on seqlog",
        qcow2_opts!(),
        seqlog_opts!(segment_size: 64 << 10),
        Backend::Memory,
        false
    );
    qcow2_on_seqlog_file => qcow2_on_seqlog(
        "qcow2 on seqlog on a file",
        qcow2_opts!(),
        seqlog_opts!(segment_size: 64 << 10),
        Backend::File,
        false
    );
    qcow2_on_seqlog_map_capped => qcow2_on_seqlog(
        "qcow2 on seqlog, map memory capped at two pages of 512 B blocks",
        qcow2_opts!(),
        seqlog_opts!(block_size: 512, segment_size: 64 << 10, map_memory: 1024),
        Backend::Memory,
        false
    );
    qcow2_on_seqlog_filled => qcow2_on_seqlog(
        "qcow2 on seqlog filled, 4 KiB segments of 512 B blocks, 4 KiB clusters",
        qcow2_opts!(cluster_size: 4096),
        seqlog_opts!(block_size: 512, segment_size: 4096, spare: 10),
        Backend::Memory,
        true
    );
    pcow_64k => pcow("pcow", 64 << 10, 0, 0, false);
    pcow_2m => pcow("pcow 2 MiB clusters (wide bitmaps)", 2 << 20, 0, 0, false);
    pcow_snapshot => pcow("pcow over a snapshot", 64 << 10, 0, 1 << 40, true);
    pcow_wide_snapshot =>
        pcow("pcow 256 KiB clusters over a snapshot", 256 << 10, 0, 1 << 40, true);
    // 4 KiB clusters: 504 to a segment, 503 of them filled, so new clusters start segments.
    pcow_segments => pcow("pcow past a segment", 4096, 4 << 20, 503 * 4096, false);
    pcow_over_raw => pcow_over_raw("pcow over raw", 64 << 10);
    pcow_over_pcow_over_raw => pcow_over_pcow_over_raw("pcow over pcow over pcow over raw");
}
