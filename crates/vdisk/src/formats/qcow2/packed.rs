//! Writing compressed clusters (`convert -c`): each cluster is compressed on its own and packed
//! byte by byte after the previous one, several to a host cluster, as QEMU does. A host cluster
//! holding parts of k compressed clusters has refcount k.

use super::compress::compress;
use super::l2::{L2Entry, OFLAG_COMPRESSED};
use super::meta::Meta;
use super::offset::Guest;
use super::Qcow2;
use crate::blockdev::{check_range, BlockDev};
use crate::error::{Error, IoContext, Result};

impl Qcow2 {
    /// Writes one whole guest cluster at `offset` compressed; data that does not compress is
    /// written plainly. The last cluster of a disk whose size is not a multiple of the cluster
    /// size may be short: it is padded with zeroes.
    pub fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<()> {
        if self.format.external_data {
            // As QEMU: compressed clusters live in the image file, which an external data
            // file leaves no guest data in.
            return Err(Error::unsupported("Operation not supported"));
        }
        let cs = self.header.cluster_size();
        check_range(self.size, offset, data.len() as u64)?;
        if offset % cs != 0
            || data.len() as u64 > cs
            || (data.len() as u64) < cs.min(self.size - offset)
        {
            return Err(Error::invalid(
                "compressed writes must cover exactly one cluster",
            ));
        }
        let mut cluster;
        let input = if data.len() as u64 == cs {
            data
        } else {
            cluster = vec![0u8; cs as usize];
            cluster[..data.len()].copy_from_slice(data);
            &cluster[..]
        };
        let Some(packed) = compress(self.header.compression, input) else {
            return self.write(offset, data);
        };
        let _pass = self.gate.enter();
        let host = {
            let mut meta = self.lock();
            let (table, index, old) = self.writable_table(&mut meta, Guest(offset))?;
            meta.pending.remove(&Guest(offset));
            let host = self.pack(&mut meta, packed.len() as u64)?;
            self.free_entry_later(&mut meta, old);
            let cb = self.header.cluster_bits;
            let shift = 62 - (cb - 8);
            let sectors = ((host + packed.len() as u64 - 1) >> 9) - (host >> 9);
            let word = OFLAG_COMPRESSED | sectors << shift | host;
            meta.tables
                .set_entry(table, index, L2Entry { word, bitmap: 0 });
            meta.txn.data_written = true;
            meta.txn.ordered = true;
            host
        };
        self.data
            .write_at(host, &packed)
            .context(|| format!("writing a compressed cluster at {host:#x}"))
    }

    /// Host bytes for `len` bytes of compressed data, placed as QEMU's `qcow2_alloc_bytes`
    /// places them: right after the previous compressed cluster, running on into the next
    /// host cluster when that one is free; else at the start of a new cluster. Every host
    /// cluster the data touches gains one reference.
    fn pack(&self, meta: &mut Meta, len: u64) -> Result<u64> {
        let cs = self.header.cluster_size();
        let cb = self.header.cluster_bits;
        let tail = meta.packed.tail;
        let host = if tail % cs != 0 {
            if tail % cs + len > cs {
                let next = self.alloc_clusters(meta, 1)?;
                if next != (tail >> cb) + 1 {
                    return Ok(self.packed_at(meta, next << cb, len));
                }
            }
            let refs = meta.refs();
            let r = refs.get(&*self.file, tail >> cb)?;
            refs.set(&*self.file, tail >> cb, r + 1)?;
            tail
        } else {
            self.alloc_clusters(meta, 1)? << cb
        };
        Ok(self.packed_at(meta, host, len))
    }

    fn packed_at(&self, meta: &mut Meta, host: u64, len: u64) -> u64 {
        meta.packed.tail = host + len;
        meta.packed.end = meta.packed.end.max(host + len);
        host
    }
}
