//! Copy-on-write work, concurrency and failures of the qcow2 write path, read from the engine's
//! counters: clusters covered completely before a flush copy nothing, gaps are filled from the
//! backing file once, new space beyond the end of the file is never zero-filled, concurrent
//! writes into one new cluster all land, and an injected EIO or ENOSPC at any storage call
//! leaves an image that checks without corruption and holds every acknowledged write.
//!
//! | file             | what it holds                                              |
//! |------------------|------------------------------------------------------------|
//! | `common.rs`      | the images the tests write to, and the check they end with |
//! | `cow.rs`         | copy-on-write: what is copied, read and zeroed, and when   |
//! | `space.rs`       | syncs per flush, host space taken and given back           |
//! | `failures.rs`    | an EIO or ENOSPC injected at every storage call            |
//! | `started.rs`     | started writes and reads: transfers made by the caller     |
//! | `concurrency.rs` | writers, readers and flushes at once                       |

#[path = "qcow2_cow/common.rs"]
mod common;
#[path = "qcow2_cow/concurrency.rs"]
mod concurrency;
#[path = "qcow2_cow/cow.rs"]
mod cow;
#[path = "qcow2_cow/failures.rs"]
mod failures;
#[path = "qcow2_cow/space.rs"]
mod space;
#[path = "qcow2_cow/started.rs"]
mod started;
