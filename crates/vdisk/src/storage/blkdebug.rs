//! QEMU's blkdebug driver (block/blkdebug.c): a node that passes every request through to its
//! child, except those its rules fail. A rule is armed by an event, which the format above
//! reports where QEMU's `BLKDBG_EVENT` does (`read_aio` before reading a data cluster,
//! `write_aio` before writing one; `none` when the node opens); once armed, the next requests
//! of the rule's kinds (and at its sector, if it names one) fail with its errno until another
//! event arms other rules, or at once if it is `once`. `set-state` rules move the node to
//! another state, and a rule with a state fires only in that state.
//!
//! [`Rules`] is that engine; [`BlkdebugStorage`] puts it between a format and its file (the
//! `blkdebug:CONF:FILE` protocol, a `file` or `data-file` child of driver blkdebug), and
//! `formats::image` above a whole format (driver blkdebug over a format node).

use std::io;
use std::sync::{Arc, Mutex};

use super::{HostStatus, Storage, WriteHint};
use crate::sync::lock;

/// QEMU's `BlkdebugEvent` names, in its order: rules may name any of them, though vdisk's
/// formats report only [`DebugEvent`]'s.
pub const EVENT_NAMES: &[&str] = &[
    "l1_update",
    "l1_grow_alloc_table",
    "l1_grow_write_table",
    "l1_grow_activate_table",
    "l2_load",
    "l2_update",
    "l2_update_compressed",
    "l2_alloc_cow_read",
    "l2_alloc_write",
    "read_aio",
    "read_backing_aio",
    "read_compressed",
    "write_aio",
    "write_compressed",
    "vmstate_load",
    "vmstate_save",
    "cow_read",
    "cow_write",
    "reftable_load",
    "reftable_grow",
    "reftable_update",
    "refblock_load",
    "refblock_update",
    "refblock_update_part",
    "refblock_alloc",
    "refblock_alloc_hookup",
    "refblock_alloc_write",
    "refblock_alloc_write_blocks",
    "refblock_alloc_write_table",
    "refblock_alloc_switch_table",
    "cluster_alloc",
    "cluster_alloc_bytes",
    "cluster_free",
    "flush_to_os",
    "flush_to_disk",
    "pwritev_rmw_head",
    "pwritev_rmw_after_head",
    "pwritev_rmw_tail",
    "pwritev_rmw_after_tail",
    "pwritev",
    "pwritev_zero",
    "pwritev_done",
    "empty_image_prepare",
    "l1_shrink_write_table",
    "l1_shrink_free_l2_clusters",
    "cor_write",
    "cluster_alloc_space",
    "none",
];

/// QEMU's `BlkdebugIOType` names, in its order (bit i of [`Inject::iotypes`] is the i-th).
pub const IOTYPE_NAMES: &[&str] = &[
    "read",
    "write",
    "write-zeroes",
    "discard",
    "flush",
    "block-status",
];

/// The kinds of request a rule can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoType {
    Read = 0,
    Write = 1,
    WriteZeroes = 2,
    Discard = 3,
    Flush = 4,
    BlockStatus = 5,
}

/// The events vdisk's formats report to the storage below them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DebugEvent {
    /// A data cluster is about to be read.
    ReadAio,
    /// A data cluster is about to be written.
    WriteAio,
    /// The node opened.
    None,
}

impl DebugEvent {
    pub fn name(self) -> &'static str {
        match self {
            DebugEvent::ReadAio => "read_aio",
            DebugEvent::WriteAio => "write_aio",
            DebugEvent::None => "none",
        }
    }
}

/// What a rule does when its event fires.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Inject(Inject),
    /// Moves the node to this state.
    SetState(u64),
}

/// An error to inject (QEMU's `inject-error`).
#[derive(Debug, Clone, PartialEq)]
pub struct Inject {
    /// Bit per [`IoType`]: the kinds of request that fail.
    pub iotypes: u8,
    pub errno: i32,
    /// Disarmed (and dropped) after failing one request.
    pub once: bool,
    /// Only a request covering this byte fails.
    pub offset: Option<u64>,
}

/// One rule: its event (an index into [`EVENT_NAMES`]), the state it fires in (0: any) and
/// its action.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub event: usize,
    pub state: u64,
    pub action: Action,
}

/// The rules of a blkdebug node and its state.
#[derive(Debug)]
pub struct Rules {
    inner: Mutex<State>,
}

#[derive(Debug)]
struct State {
    rules: Vec<Rule>,
    /// Indices into `rules` of the armed inject rules, the latest first.
    active: Vec<usize>,
    state: u64,
}

impl Rules {
    /// The rules of a node that has just opened: those of event `none` are armed.
    pub fn new(rules: Vec<Rule>) -> Rules {
        let r = Rules {
            inner: Mutex::new(State {
                rules,
                active: Vec::new(),
                state: 1,
            }),
        };
        r.event(DebugEvent::None);
        r
    }

    /// Fires `event`: its inject rules (of the current state) become the armed ones, its
    /// set-state rules move the state.
    pub fn event(&self, event: DebugEvent) {
        let Some(index) = EVENT_NAMES.iter().position(|n| *n == event.name()) else {
            return;
        };
        let mut s = lock(&self.inner);
        let mut new_state = s.state;
        // QEMU walks the event's rules latest first (QLIST_INSERT_HEAD), each one put at the
        // head of the armed list.
        let firing: Vec<usize> = (0..s.rules.len())
            .rev()
            .filter(|&i| {
                let rule = &s.rules[i];
                rule.event == index && (rule.state == 0 || rule.state == s.state)
            })
            .collect();
        let mut injects = 0;
        for i in firing {
            match s.rules[i].action {
                Action::Inject(_) => {
                    if injects == 0 {
                        s.active.clear();
                    }
                    injects += 1;
                    s.active.insert(0, i);
                }
                Action::SetState(n) => new_state = n,
            }
        }
        s.state = new_state;
    }

    /// Fails a request of `kind` over `[offset, offset + len)` if an armed rule says so.
    pub fn check(&self, kind: IoType, offset: u64, len: u64) -> io::Result<()> {
        let mut s = lock(&self.inner);
        let hit = s.active.iter().position(|&i| match &s.rules[i].action {
            Action::Inject(inj) => {
                let at = inj
                    .offset
                    .is_none_or(|o| len > 0 && o >= offset && o - offset < len);
                at && inj.iotypes & (1 << kind as u8) != 0
            }
            Action::SetState(_) => false,
        });
        let Some(pos) = hit else { return Ok(()) };
        let rule = s.active[pos];
        let Action::Inject(inj) = s.rules[rule].action.clone() else {
            return Ok(());
        };
        if inj.errno == 0 {
            return Ok(());
        }
        if inj.once {
            // The rule is gone for good: its index is no longer armed nor fires again.
            s.active.remove(pos);
            s.rules[rule].event = usize::MAX;
        }
        Err(io::Error::from_raw_os_error(inj.errno))
    }
}

/// A blkdebug node over the storage `inner`.
pub struct BlkdebugStorage {
    inner: Arc<dyn Storage>,
    rules: Rules,
}

impl BlkdebugStorage {
    pub fn new(inner: Arc<dyn Storage>, rules: Vec<Rule>) -> Self {
        BlkdebugStorage {
            inner,
            rules: Rules::new(rules),
        }
    }
}

fn total(bufs: &[impl AsRef<[u8]>]) -> u64 {
    bufs.iter().map(|b| b.as_ref().len() as u64).sum()
}

impl Storage for BlkdebugStorage {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.rules.check(IoType::Read, offset, buf.len() as u64)?;
        self.inner.read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.rules.check(IoType::Write, offset, buf.len() as u64)?;
        self.inner.write_at(offset, buf)
    }

    fn write_at_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> io::Result<()> {
        self.rules.check(IoType::Write, offset, buf.len() as u64)?;
        self.inner.write_at_hinted(offset, buf, hint)
    }

    fn read_vectored_at(&self, offset: u64, bufs: &mut [&mut [u8]]) -> io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.rules.check(IoType::Read, offset, len)?;
        self.inner.read_vectored_at(offset, bufs)
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.rules.check(IoType::Write, offset, total(bufs))?;
        self.inner.write_vectored_at(offset, bufs)
    }

    fn sync(&self) -> io::Result<()> {
        self.rules.check(IoType::Flush, 0, 0)?;
        self.inner.sync()
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.rules.check(IoType::WriteZeroes, offset, len)?;
        self.inner.allocate(offset, len)
    }

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.rules.check(IoType::Discard, offset, len)?;
        self.inner.punch_hole(offset, len)
    }

    fn extent_at(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        self.rules.check(IoType::BlockStatus, offset, len)?;
        self.inner.extent_at(offset, len)
    }

    fn status_at(&self, offset: u64, len: u64) -> io::Result<HostStatus> {
        self.rules.check(IoType::BlockStatus, offset, len)?;
        self.inner.status_at(offset, len)
    }

    fn debug_event(&self, event: DebugEvent) {
        self.rules.event(event);
    }

    crate::forward_storage!(inner: len, set_len, allocated_bytes, fixed_size, stats);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    fn inject(event: &str, iotypes: u8, errno: i32, once: bool, offset: Option<u64>) -> Rule {
        Rule {
            event: EVENT_NAMES.iter().position(|n| *n == event).unwrap(),
            state: 0,
            action: Action::Inject(Inject {
                iotypes,
                errno,
                once,
                offset,
            }),
        }
    }

    #[test]
    fn rules_arm_on_their_event_and_fail_what_they_name() {
        let s = BlkdebugStorage::new(
            Arc::new(MemStorage::new()),
            vec![
                inject("read_aio", 1, libc::EIO, false, None),
                inject("write_aio", 2, libc::ENOSPC, true, None),
                inject("none", 1, libc::EIO, false, Some(4096)),
            ],
        );
        let mut buf = [0u8; 512];
        s.write_at(0, &[1u8; 8192]).unwrap();
        // Armed at open: only a read covering byte 4096 fails.
        s.read_at(0, &mut buf).unwrap();
        let e = s.read_at(4000, &mut buf).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        // write_aio disarms it and fails one write, then nothing.
        s.debug_event(DebugEvent::WriteAio);
        s.read_at(4000, &mut buf).unwrap();
        let e = s.write_at(0, &buf).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        s.write_at(0, &buf).unwrap();
        s.debug_event(DebugEvent::WriteAio);
        s.write_at(0, &buf).unwrap();
        // read_aio fails every read from then on, not writes.
        s.debug_event(DebugEvent::ReadAio);
        assert!(s.read_at(0, &mut buf).is_err());
        assert!(s.read_at(0, &mut buf).is_err());
        s.write_at(0, &buf).unwrap();
    }
}
