//! Epochs (the operations between two syncs) and the crash images each can leave.

use std::fmt;

use super::plan::{plans, Persisted, Plan};
use super::{CrashOptions, Op};

/// The operations between two syncs (or after the last one), and the durable contents before them.
#[derive(Debug, Clone)]
pub struct Epoch {
    /// Epochs are numbered by the syncs that close them: epoch `i` ends with sync `i` (from 0,
    /// counted since the storage was created, also across [`super::CrashStorage::forget_history`]).
    pub index: usize,
    /// Whether a sync closed the epoch; false for the open one at the end.
    pub synced: bool,
    /// Durable contents when the epoch began.
    pub base: Vec<u8>,
    /// Operations issued during the epoch, in order.
    pub ops: Vec<Op>,
    /// How many crash images to produce: the recording storage's options.
    pub options: CrashOptions,
}

impl Epoch {
    /// The contents once every operation of the epoch is durable.
    pub fn end(&self) -> Vec<u8> {
        let mut image = self.base.clone();
        self.ops.iter().for_each(|op| op.apply(&mut image));
        image
    }

    /// Every disk a power loss before the epoch's sync could leave (see the module docs).
    pub fn crash_images(&self) -> CrashImages {
        self.clone().into_crash_images()
    }

    /// As [`Self::crash_images`], without copying the epoch.
    pub fn into_crash_images(self) -> CrashImages {
        let plans = plans(&self.ops, &self.options, self.index);
        CrashImages {
            epoch: self,
            plans: plans.into_iter(),
        }
    }
}

/// A disk as a power loss could leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashImage {
    /// The epoch in which the power failed.
    pub epoch: usize,
    /// The unsynced operations of that epoch that reached the disk, in issue order.
    pub persisted: Vec<Persisted>,
    pub bytes: Vec<u8>,
}

impl fmt::Display for CrashImage {
    /// Names the crash for a failing assertion: `epoch 3, persisted ops [0, 2 (sectors 1 3)] of 4096 bytes`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {}, persisted ops [", self.epoch)?;
        for (i, p) in self.persisted.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}", p.op)?;
            if let Some(sectors) = &p.sectors {
                let list: Vec<String> = sectors.iter().map(|s| s.to_string()).collect();
                write!(f, " (sectors {})", list.join(" "))?;
            }
        }
        write!(f, "] of {} bytes", self.bytes.len())
    }
}

/// The crash images of one epoch, built one at a time.
#[derive(Debug)]
pub struct CrashImages {
    epoch: Epoch,
    plans: std::vec::IntoIter<Plan>,
}

impl Iterator for CrashImages {
    type Item = CrashImage;

    fn next(&mut self) -> Option<CrashImage> {
        let persisted = self.plans.next()?;
        let mut bytes = self.epoch.base.clone();
        for p in &persisted {
            let op = &self.epoch.ops[p.op];
            match &p.sectors {
                None => op.apply(&mut bytes),
                Some(sectors) => op.apply_sectors(&mut bytes, sectors),
            }
        }
        Some(CrashImage {
            epoch: self.epoch.index,
            persisted,
            bytes,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.plans.size_hint()
    }
}

impl ExactSizeIterator for CrashImages {}

/// Every recorded epoch, oldest first, ending with the open one. Replays the history as it goes,
/// so each epoch's base is built only when that epoch is reached.
#[derive(Debug)]
pub struct Epochs {
    pub(super) index: usize,
    pub(super) running: Vec<u8>,
    pub(super) synced: std::vec::IntoIter<Vec<Op>>,
    pub(super) open: Option<Vec<Op>>,
    pub(super) options: CrashOptions,
}

impl Iterator for Epochs {
    type Item = Epoch;

    fn next(&mut self) -> Option<Epoch> {
        let (ops, synced) = match self.synced.next() {
            Some(ops) => (ops, true),
            None => (self.open.take()?, false),
        };
        let base = self.running.clone();
        if synced {
            ops.iter().for_each(|op| op.apply(&mut self.running));
        }
        self.index += 1;
        Some(Epoch {
            index: self.index - 1,
            synced,
            base,
            ops,
            options: self.options,
        })
    }
}
