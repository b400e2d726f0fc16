//! What a disk may hold after a crash or a failed request: the model as of the last completed
//! flush, with any byte changed by a request started since holding its old or its new value.

use super::model::{pattern, Model};
use super::workload::Op;

/// How far a workload had got: flushes completed and requests started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub flushes: usize,
    pub started: usize,
}

pub struct History {
    initial: Vec<u8>,
    /// The model when each flush completed (the fresh disk first) and how many requests had
    /// started by then.
    flushed: Vec<(Vec<u8>, usize)>,
    started: Vec<Op>,
}

impl History {
    pub fn new(model: &Model) -> History {
        History {
            initial: model.initial.clone(),
            flushed: vec![(model.bytes.clone(), 0)],
            started: Vec::new(),
        }
    }

    pub fn progress(&self) -> Progress {
        Progress {
            flushes: self.flushed.len() - 1,
            started: self.started.len(),
        }
    }

    /// `op` is about to be sent: from now on its bytes may be on the storage.
    pub fn start(&mut self, op: &Op) -> Progress {
        self.started.push(op.clone());
        self.progress()
    }

    /// A flush (or write_fua, or close) completed: `model` is durable.
    pub fn flushed(&mut self, model: &Model) -> Progress {
        self.flushed.push((model.bytes.clone(), self.started.len()));
        self.progress()
    }

    /// Whether `op` may have left `value` at byte `b`.
    fn may_hold(&self, op: &Op, b: u64, value: u8) -> bool {
        match *op {
            Op::Write { offset, len, seed } | Op::WriteFua { offset, len, seed } => {
                (offset..offset + len).contains(&b) && pattern(seed, b) == value
            }
            Op::Zeroes { offset, len } => (offset..offset + len).contains(&b) && value == 0,
            Op::Discard { offset, len } => {
                (offset..offset + len).contains(&b)
                    && (value == 0 || value == self.initial[b as usize])
            }
            Op::Flush => false,
        }
    }

    /// Checks a disk read whole (`got`) after a crash or failure at `at`: every byte holds
    /// what the last completed flush made durable, or what a request started since put there.
    pub fn check(&self, got: &[u8], at: Progress) -> Result<(), String> {
        let (base, since) = &self.flushed[at.flushes];
        let ops = &self.started[*since..at.started];
        let mut bad = Vec::new();
        for (chunk, (g, w)) in got.chunks(4096).zip(base.chunks(4096)).enumerate() {
            if g == w {
                continue;
            }
            for (i, (&v, &want)) in g.iter().zip(w).enumerate() {
                let b = (chunk * 4096 + i) as u64;
                if v != want && !ops.iter().any(|op| self.may_hold(op, b, v)) {
                    bad.push((b, v, want));
                }
            }
        }
        let Some(&(b, v, want)) = bad.first() else {
            return Ok(());
        };
        let touching: Vec<&Op> = ops
            .iter()
            .filter(|op| op.range().is_some_and(|(o, l)| (o..o + l).contains(&b)))
            .collect();
        Err(format!(
            "{} bytes hold what was neither flushed nor written since; first at {b:#x}: {v:#04x}, \
             flushed {want:#04x} ({} flushes, {} requests started; since the flush: {touching:?})",
            bad.len(),
            at.flushes,
            at.started
        ))
    }
}
