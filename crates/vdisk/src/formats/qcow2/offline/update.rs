//! Changes to the header of an open image: writing it, and pointing it at another backing file
//! (`vdisk rebase`), plus emptying the active image (`vdisk commit`).

use crate::error::{IoContext, Result};
use crate::formats::qcow2::header::Header;
use crate::formats::qcow2::Qcow2;
use crate::storage::WriteHint;

impl Qcow2 {
    /// Writes header `h` and syncs it, then commits what it freed. The refcount table's place
    /// comes from the refcounts, not from `h` (a copy of the header as opened may be older than
    /// a move of the table); a moved table is made durable first.
    pub(in crate::formats::qcow2) fn write_header(&self, h: &mut Header) -> Result<()> {
        {
            let mut meta = self.lock();
            let refs = meta.refs();
            if refs.table_moved() {
                let bytes = refs.write_out(&*self.file)?;
                self.file
                    .sync()
                    .context(|| "syncing the new refcount table".into())?;
                self.counters.metadata_written(bytes);
            }
            let (offset, clusters) = refs.table_location();
            h.refcount_table_offset = offset;
            h.refcount_table_clusters = clusters as u32;
        }
        // The whole first cluster, as QEMU writes it: no old backing file name is left behind.
        let mut bytes = h.to_bytes()?;
        bytes.resize(bytes.len().max(h.cluster_size() as usize), 0);
        self.file
            .write_at_hinted(0, &bytes, WriteHint::Metadata)
            .context(|| "writing the header".into())?;
        let frees = self.lock().refs().take_frees();
        let synced = self.file.sync().context(|| "syncing the header".into());
        let mut meta = self.lock();
        let refs = meta.refs();
        if let Err(e) = synced {
            refs.defer_frees(frees);
            return Err(e);
        }
        refs.table_named();
        self.counters.metadata_written(bytes.len() as u64);
        // The old L1 table's clusters are free now that the header points elsewhere.
        refs.apply_frees(&*self.file, frees)
    }

    /// Names `name` (of format `format`) as the backing file, or none. Only the header
    /// changes: the caller has made the image's content independent of the old backing file
    /// where it must be (or asked for an unsafe rebase).
    pub fn set_backing(&mut self, name: Option<&str>, format: Option<&str>) -> Result<()> {
        self.writable_or_err("rebase")?;
        self.flush_impl()?;
        let mut h: Header = self.header.clone();
        h.backing_file = name.map(str::to_string);
        h.backing_format = format.map(str::to_string);
        self.write_header(&mut h)?;
        self.header = h;
        Ok(())
    }

    /// Unmaps every cluster of the active image, so that all of it reads from the backing file
    /// again (after its data was committed there).
    pub fn make_empty(&mut self) -> Result<()> {
        self.writable_or_err("commit")?;
        self.drop_beyond(0)?;
        self.flush_impl()
    }
}
