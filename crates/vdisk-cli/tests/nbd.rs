//! `vdisk serve` against real NBD clients (qemu-img, qemu-io, nbdinfo, nbdcopy, fio), started
//! by the tests; the protocol itself through a small client of our own (options, errors,
//! structured replies, block status, pipelining); and a fuzz test that throws random and
//! mutated byte streams at an in-process server while a well-behaved client keeps working.
//! `nbd_hardening/` holds the tests of what outside probes do (issue 28): idle sockets,
//! connection limits, long negotiations, and what the server logs.
//!
//! | file                | what it holds                                                   |
//! |---------------------|-----------------------------------------------------------------|
//! | `nbd_common/`       | peer tools, `vdisk serve`, in-process servers, our client, fuzz |
//! | `nbd_hardening/`    | idle sockets, connection limits, long negotiations, the log     |
//! | `nbd/common.rs`     | export options, qemu-io pattern runs, metrics of `vdisk stats`  |
//! | `nbd/protocol.rs`   | the handshake's options, simple replies, errors                 |
//! | `nbd/data_path.rs`  | holes, block status of a chain, pipelining, the I/O queue       |
//! | `nbd/robustness.rs` | garbage and fuzzed streams beside a well-behaved client         |
//! | `nbd/qemu_tools.rs` | qemu-img and qemu-io over NBD, in every I/O mode                |
//! | `nbd/clients.rs`    | nbdinfo, nbdcopy and fio, checked against qemu-nbd              |
//! | `nbd/cache.rs`      | cache modes: O_DIRECT, syncs, the page cache                    |
//! | `nbd/failures.rs`   | SIGTERM under load, a full host disk, mixed alignment           |
//! | `nbd/locks.rs`      | QEMU's image locks between vdisk and QEMU's tools               |

mod nbd_common;
mod nbd_hardening;

#[path = "nbd/cache.rs"]
mod cache;
#[path = "nbd/clients.rs"]
mod clients;
#[path = "nbd/common.rs"]
mod common;
#[path = "nbd/data_path.rs"]
mod data_path;
#[path = "nbd/failures.rs"]
mod failures;
#[path = "nbd/locks.rs"]
mod locks;
#[path = "nbd/protocol.rs"]
mod protocol;
#[path = "nbd/qemu_tools.rs"]
mod qemu_tools;
#[path = "nbd/robustness.rs"]
mod robustness;
