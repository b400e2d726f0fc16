//! The suite's two macros, shared by every binary that runs it (`conformance.rs`, and
//! `rbd_conformance.rs` on a Ceph cluster): `subjects!` stamps a module per subject, `bodies!`
//! a test per body in it. A subject may name a condition (`, if EXPR`) without which its tests
//! pass at once (a peer missing outside CI).

/// Stamps one `#[test]` per body for the subject `subject()` of the enclosing module.
macro_rules! bodies {
    ($($(#[$attr:meta])* $module:ident :: $body:ident),* $(,)?) => {
        $(
            #[test]
            $(#[$attr])*
            fn $body() {
                if !available() {
                    return;
                }
                crate::$module::$body(&subject());
            }
        )*
    };
}

/// One module per subject, holding one test per body.
macro_rules! subjects {
    ($($name:ident => $make:expr $(, if $available:expr)?;)*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::subject::*;
                #[allow(unused_imports)]
                use super::{CreateOptions, Policy};

                fn subject() -> Subject {
                    $make
                }

                /// Whether the subject can run here (its peers are installed).
                fn available() -> bool {
                    true $(&& $available)?
                }

                bodies! {
                    io::fresh_disk_reads_its_initial_content,
                    io::writes_of_every_size_read_back,
                    io::out_of_range_requests_fail,
                    zeroes::write_zeroes_reads_zero,
                    zeroes::fast_zeroes_zero_or_refuse,
                    zeroes::discard_reads_as_allowed,
                    status::block_status_agrees_with_reads,
                    status::offsets_hold_the_data_before_a_flush,
                    started::started_writes_and_reads_transfer_the_data,
                    started::failed_started_writes_leave_old_or_new_data,
                    started::failed_write_keeps_earlier_unflushed_writes,
                    durability::flush_and_fua_make_writes_durable,
                    durability::close_and_reopen_keep_everything,
                    durability::drop_without_close_keeps_writes,
                    durability::concurrent_writers_lose_nothing,
                    crash::crash_states_keep_flushed_writes,
                    fault::faults_fail_requests_and_keep_flushed_data,
                    fault::read_faults_fail_reads_not_data,
                }
            }
        )*
    };
}
