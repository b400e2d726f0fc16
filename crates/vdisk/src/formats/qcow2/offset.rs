//! Guest and host offsets as distinct types where they meet: the L1 and L2 tables turn a guest
//! offset into a host offset of the image (or data) file, and a function that takes one must
//! not be handed the other (nor name the wrong one in a corruption message).

/// A byte offset in the disk the guest sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct Guest(pub u64);

/// A byte offset in the image file, or in its external data file for guest data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(super) struct Host(pub u64);

impl Guest {
    /// The start of the cluster (of `1 << cluster_bits` bytes) holding this offset.
    pub fn cluster_start(self, cluster_bits: u32) -> Guest {
        Guest(self.0 & !((1 << cluster_bits) - 1))
    }
}

impl Host {
    /// The index of the host cluster holding this offset.
    pub fn cluster(self, cluster_bits: u32) -> u64 {
        self.0 >> cluster_bits
    }
}

impl std::ops::Add<u64> for Host {
    type Output = Host;
    fn add(self, n: u64) -> Host {
        Host(self.0 + n)
    }
}

impl std::ops::Add<u64> for Guest {
    type Output = Guest;
    fn add(self, n: u64) -> Guest {
        Guest(self.0 + n)
    }
}
