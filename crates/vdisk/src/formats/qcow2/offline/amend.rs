//! Changing the options of an existing image (`vdisk amend`), as QEMU's `qcow2_amend_options`.
//!
//! Every refusal QEMU makes is checked before anything changes, so that a refused amend leaves
//! the image as it was (QEMU refuses some only halfway: `compat=0.10,size=...` on an image with
//! snapshots resizes, then refuses the downgrade). Then, in QEMU's order:
//!
//! 1. an upgrade to version 3 first rewrites a snapshot table whose entries lack the extra data
//!    v3 requires (a table v2 reads as well);
//! 2. the header-only changes (version 3, lazy refcounts, the data file's name, data-file-raw)
//!    are written in one header write, together with a new refcount width when one is asked
//!    for (`refcount_width.rs`);
//! 3. the virtual size changes (`resize.rs`);
//! 4. a downgrade to version 2 turns every zero cluster into one v2 reads (`downgrade.rs`), then
//!    writes the v2 header.
//!
//! Each step is crash safe on its own: a crash leaves the image as before or after the step,
//! at worst with leaked clusters.

use crate::error::{Error, Result};
use crate::formats::info::AmendOptions;
use crate::formats::prealloc::Preallocation;
use crate::formats::qcow2::header::{
    Compression, Header, AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, INCOMPAT_COMPRESSION,
    INCOMPAT_DATA_FILE,
};
use crate::formats::qcow2::snapshot::Snapshot;
use crate::formats::qcow2::Qcow2;

/// What an amend will do, once every refusal was ruled out.
struct Plan {
    upgrade: bool,
    downgrade: bool,
    /// The new refcount order, when it changes.
    refcount_order: Option<u32>,
    size: Option<u64>,
}

impl Qcow2 {
    /// Changes the image's options as `qemu-img amend` does (see the module docs).
    pub fn amend(&mut self, o: &AmendOptions) -> Result<()> {
        self.writable_or_err("amend")?;
        let plan = self.plan(o)?;
        self.flush_impl()?;
        if plan.upgrade {
            self.upgrade_snapshots()?;
        }
        let mut h = self.header.clone();
        if plan.upgrade {
            h.version = 3;
            h.header_length = 112;
        }
        if let Some(on) = o.lazy_refcounts {
            h.compatible = flag(h.compatible, COMPAT_LAZY_REFCOUNTS, on);
        }
        if let Some(raw) = o.data_file_raw {
            h.autoclear = flag(h.autoclear, AUTOCLEAR_DATA_FILE_RAW, raw);
        }
        // An empty name drops it, as in QEMU: the image then opens only with a `data-file`
        // option.
        if let Some(name) = &o.data_file {
            h.data_file = (!name.is_empty()).then(|| name.clone());
        }
        match plan.refcount_order {
            Some(order) => self.change_refcount_order(h, order)?,
            None if h.to_bytes()? != self.header.to_bytes()? => {
                self.write_header(&mut h)?;
                self.header = h;
            }
            None => {}
        }
        if let Some(size) = plan.size {
            self.resize(size, Preallocation::Off)?;
        }
        if plan.downgrade {
            self.downgrade()?;
        }
        Ok(())
    }

    /// Rules out everything QEMU would refuse, in the order it refuses it, with its messages.
    fn plan(&self, o: &AmendOptions) -> Result<Plan> {
        let h = &self.header;
        let has_data_file = h.incompatible & INCOMPAT_DATA_FILE != 0;
        if o.data_file.is_some() && !has_data_file {
            return Err(Error::invalid(
                "data-file can only be set for images that use an external data file",
            ));
        }
        if o.data_file_raw == Some(true) && !h.data_file_raw() {
            return Err(Error::invalid(
                "data-file-raw cannot be set on existing images",
            ));
        }
        let bits = o.refcount_bits.unwrap_or(u64::from(h.refcount_bits()));
        if bits == 0 || bits > 64 || !bits.is_power_of_two() {
            return Err(Error::invalid(
                "Refcount width must be a power of two and may not exceed 64 bits",
            ));
        }
        let (old_version, new_version) = (h.version, o.version.unwrap_or(h.version));
        let refcount_order = (bits != u64::from(h.refcount_bits())).then(|| bits.trailing_zeros());
        if let Some(order) = refcount_order {
            if new_version < 3 && bits != 16 {
                return Err(Error::invalid(
                    "Refcount widths other than 16 bits require compatibility level 1.1 or \
                     above (use compat=1.1 or greater)",
                ));
            }
            self.check_refcount_width(order)?;
        }
        let backing_named = o.backing_file.is_some() || o.backing_format.is_some();
        if backing_named
            && (o.backing_file != h.backing_file || o.backing_format != h.backing_format)
        {
            // The CLI adds QEMU's hint, which names the program run.
            return Err(Error::invalid("Cannot amend the backing file"));
        }
        if o.lazy_refcounts == Some(true) && !h.lazy_refcounts() && new_version < 3 {
            return Err(Error::invalid(
                "Lazy refcounts only supported with compatibility level 1.1 and above (use \
                 compat=1.1 or greater)",
            ));
        }
        let size = o.size.filter(|&s| s != 0);
        if let Some(size) = size {
            let version = old_version.max(new_version);
            self.check_resize(size, Preallocation::Off, version)?;
        }
        let downgrade = new_version < old_version;
        if downgrade {
            let order = refcount_order.unwrap_or(h.refcount_order);
            self.check_downgrade(order, size.unwrap_or(self.size))?;
        }
        Ok(Plan {
            upgrade: new_version > old_version,
            downgrade,
            refcount_order,
            size,
        })
    }

    /// QEMU's refusals of a downgrade to version 2, in its order, for the image as it will be
    /// then (refcount order `order`, virtual size `size`).
    fn check_downgrade(&self, order: u32, size: u64) -> Result<()> {
        let h = &self.header;
        if order != 4 {
            return Err(Error::unsupported("compat=0.10 requires refcount_bits=16"));
        }
        if h.incompatible & INCOMPAT_DATA_FILE != 0 {
            return Err(Error::unsupported(
                "Cannot downgrade an image with a data file",
            ));
        }
        // Other programs reading v2 would not know these sizes matter.
        let differs = |s: &Snapshot| {
            s.info.vm_state_size > u64::from(u32::MAX) || s.disk_size.unwrap_or(size) != size
        };
        if self.snapshots.iter().any(differs) {
            return Err(Error::unsupported(
                "Internal snapshots prevent downgrade of image",
            ));
        }
        let features = h.incompatible & !INCOMPAT_COMPRESSION;
        if features != 0 {
            return Err(Error::unsupported(format!(
                "Cannot downgrade an image with incompatible features {features:#x} set"
            )));
        }
        // QEMU clears the autoclear bit and keeps the bitmap directory, whose clusters v2 then
        // counts as leaked; refusing keeps the bitmaps.
        if self.has_bitmaps() {
            return Err(Error::unsupported(
                "Cannot downgrade an image with persistent bitmaps (remove them first)",
            ));
        }
        // QEMU looks at the active image only; a snapshot's zstd clusters would not read
        // either once the header says zlib.
        if h.compression != Compression::Zlib && self.has_compressed_clusters()? {
            return Err(Error::unsupported(
                "Cannot downgrade an image with zstd compression type and existing compressed \
                 clusters",
            ));
        }
        Ok(())
    }

    /// Gives every snapshot the extra data version 3 requires (64-bit VM state size, disk
    /// size, instruction count), as QEMU's `qcow2_write_snapshots` writes it; the table stays
    /// one version 2 reads.
    fn upgrade_snapshots(&mut self) -> Result<()> {
        if self.snapshots.iter().all(|s| s.extra.len() >= 16) {
            return Ok(());
        }
        let size = self.size;
        let snapshots = (self.snapshots.iter())
            .map(|s| s.with_full_extra(size))
            .collect();
        self.write_snapshot_table(snapshots)
    }

    /// Writes the version 2 header once nothing v2 cannot read is left: no zero clusters, no
    /// feature bits, zlib compression.
    fn downgrade(&mut self) -> Result<()> {
        self.expand_zero_clusters()?;
        let mut h: Header = self.header.clone();
        h.version = 2;
        h.header_length = 72;
        h.compatible = 0;
        h.autoclear = 0;
        h.incompatible = 0;
        h.compression = Compression::Zlib;
        self.write_header(&mut h)?;
        self.header = h;
        Ok(())
    }
}

fn flag(bits: u64, bit: u64, on: bool) -> u64 {
    if on {
        bits | bit
    } else {
        bits & !bit
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::blockdev::BlockDev;
    use crate::formats::qcow2::create::{create, CreateOptions};
    use crate::formats::qcow2::l2::{OFFSET_MASK, OFLAG_ZERO};
    use crate::formats::qcow2::read_header;
    use crate::formats::{open_overlay, open_storage_with, Format, Image};
    use crate::storage::{CrashOptions, CrashStorage, MemStorage, Storage};

    const SIZE: u64 = 4 << 20;

    fn backing() -> Arc<Image> {
        let mem = Arc::new(MemStorage::from_bytes(vec![0x11; SIZE as usize]));
        Arc::new(open_storage_with(mem, Some(Format::RAW), "base.raw", false).unwrap())
    }

    fn open(file: Arc<dyn Storage>, backing: Option<&Arc<Image>>, write: bool) -> Image {
        match backing {
            Some(b) => open_overlay(file, b.clone(), "t.qcow2", write).unwrap(),
            None => open_storage_with(file, Some(Format::QCOW2), "t.qcow2", write).unwrap(),
        }
    }

    /// An image (over `backing`, if any) with data, zero clusters and a snapshot "s" sharing
    /// clusters with the active image, whose L2 table was copied after the snapshot; then a
    /// zero flag on the data clusters `zero_alloc` (16: one the snapshot shares, 48: one it
    /// does not), zero clusters with a host cluster as QEMU makes them. Returns its bytes.
    fn image(o: CreateOptions, backing: Option<&Arc<Image>>, zero_alloc: &[u64]) -> Vec<u8> {
        let mem = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: SIZE,
            backing_file: backing.map(|_| "base.raw".into()),
            backing_format: backing.map(|_| "raw".into()),
            ..o
        };
        create(&*mem, None, &o).unwrap();
        let cs = o.cluster_size;
        let mut img = open(mem.clone(), backing, true);
        img.write(0, &vec![0xaa; 2 * cs as usize]).unwrap();
        img.write(16 * cs, &vec![0xbb; cs as usize]).unwrap();
        img.write_zeroes(32 * cs, 4 * cs).unwrap();
        img.flush().unwrap();
        img.driver_mut().snapshot_create("s").unwrap();
        img.write(48 * cs, &vec![0xcc; cs as usize]).unwrap();
        img.write_zeroes(0, cs).unwrap();
        img.close().unwrap();
        drop(img);
        let mut bytes = mem.to_bytes();
        let h = read_header(&MemStorage::from_bytes(bytes.clone())).unwrap();
        let be64 =
            |b: &[u8], at: u64| u64::from_be_bytes(b[at as usize..][..8].try_into().unwrap());
        let l2 = be64(&bytes, h.l1_table_offset) & OFFSET_MASK;
        for &cluster in zero_alloc {
            let at = (l2 + cluster * 8) as usize;
            let e = be64(&bytes, at as u64) | OFLAG_ZERO;
            bytes[at..at + 8].copy_from_slice(&e.to_be_bytes());
        }
        bytes
    }

    fn contents(img: &Image) -> Vec<u8> {
        let mut buf = vec![0u8; SIZE as usize];
        img.read(0, &mut buf).unwrap();
        buf
    }

    /// The active image's and snapshot "s"'s contents.
    fn both(file: Arc<dyn Storage>, backing: Option<&Arc<Image>>) -> (Vec<u8>, Vec<u8>) {
        let active = contents(&open(file.clone(), backing, false));
        let mut img = open(file, backing, false);
        img.driver_mut().load_snapshot("s").unwrap();
        (active, contents(&img))
    }

    /// Amends `bytes` with `o` on storage that records every write and sync, then checks every
    /// image a power failure could leave: no corruption (leaks only), the same contents.
    fn amend_survives_crashes(
        bytes: Vec<u8>,
        backing: Option<&Arc<Image>>,
        o: &AmendOptions,
    ) -> Header {
        let want = both(Arc::new(MemStorage::from_bytes(bytes.clone())), backing);
        let crash = Arc::new(CrashStorage::from_bytes(bytes).with_options(CrashOptions {
            exhaustive_limit: 8,
            random_subsets: 32,
            ..CrashOptions::default()
        }));
        let mut img = open(crash.clone(), backing, true);
        img.driver_mut().amend(o).unwrap();
        img.close().unwrap();
        drop(img);
        let done = Arc::new(MemStorage::from_bytes(crash.to_bytes()));
        let mut images = 0;
        for image in crash.all_crash_images() {
            images += 1;
            let file: Arc<dyn Storage> = Arc::new(MemStorage::from_bytes(image.bytes.clone()));
            let img = open(file.clone(), backing, false);
            let mut said = Vec::new();
            let report = img.driver().check(&mut |m| said.push(m)).unwrap();
            assert_eq!(
                (report.corruptions, report.check_errors),
                (0, 0),
                "crash image {image}: {said:?}"
            );
            assert!(
                both(file, backing) == want,
                "crash image {image}: contents changed"
            );
        }
        assert!(images > 1);
        let img = open(done.clone(), backing, false);
        let report = img.driver().check(&mut |_| {}).unwrap();
        assert_eq!((report.corruptions, report.leaks), (0, 0));
        read_header(&*done).unwrap()
    }

    #[test]
    fn a_downgrade_expands_zero_clusters_crash_safely() {
        let base = backing();
        // Without a backing file and a shared cluster, only the cluster that keeps its place
        // gets zeroes: nothing else needs a commit barrier before the mapping.
        for (backing, zero_alloc) in [(Some(&base), &[16, 48][..]), (None, &[48])] {
            let bytes = image(CreateOptions::default(), backing, zero_alloc);
            let o = AmendOptions {
                version: Some(2),
                ..AmendOptions::default()
            };
            let h = amend_survives_crashes(bytes, backing, &o);
            assert_eq!(h.version, 2);
        }
    }

    #[test]
    fn a_new_refcount_width_is_written_crash_safely() {
        let backing = backing();
        for (cluster_size, bits) in [(512, 2), (512, 64), (65536, 8)] {
            let o = CreateOptions {
                cluster_size,
                ..CreateOptions::default()
            };
            let bytes = image(o, Some(&backing), &[16, 48]);
            let o = AmendOptions {
                refcount_bits: Some(bits),
                ..AmendOptions::default()
            };
            let h = amend_survives_crashes(bytes, Some(&backing), &o);
            assert_eq!(h.refcount_bits(), bits as u32);
        }
    }

    #[test]
    fn a_new_refcount_width_covers_structures_longer_than_a_block_range() {
        // 16-bit blocks of 512-byte clusters count 256 clusters; 64-bit ones 64: the new
        // structure spans several old ranges, whose blocks the allocation creates past it.
        let mem = Arc::new(MemStorage::new());
        let o = CreateOptions {
            size: 16 << 20,
            cluster_size: 512,
            ..CreateOptions::default()
        };
        create(&*mem, None, &o).unwrap();
        let data = vec![0x5a; 12 << 20];
        let mut img = open(mem.clone(), None, true);
        img.write(1 << 20, &data).unwrap();
        for bits in [64, 1, 16] {
            let o = AmendOptions {
                refcount_bits: Some(bits),
                ..AmendOptions::default()
            };
            img.driver_mut().amend(&o).unwrap();
            img.close().unwrap();
            let view = open(
                Arc::new(MemStorage::from_bytes(mem.to_bytes())),
                None,
                false,
            );
            let report = view.driver().check(&mut |_| {}).unwrap();
            assert_eq!((report.corruptions, report.leaks), (0, 0), "{bits} bits");
            let h = read_header(&**view.file()).unwrap();
            assert_eq!(h.refcount_bits(), bits as u32);
            let mut back = vec![0u8; data.len()];
            view.read(1 << 20, &mut back).unwrap();
            assert!(back == data, "{bits} bits");
        }
    }

    #[test]
    fn v2_snapshots_get_the_extra_data_v3_requires() {
        let mut s = Snapshot::new("1".into(), "s".into(), 1 << 16, 1, 10 << 20);
        s.extra.clear();
        s.extra_len = 0;
        s.disk_size = None;
        s.info.icount = None;
        s.info.vm_state_size = 5;
        let v3 = s.with_full_extra(20 << 20);
        assert_eq!(v3.extra.len(), 24);
        assert_eq!(v3.disk_size, Some(20 << 20));
        let bytes = v3.to_bytes();
        let file = MemStorage::from_bytes(bytes);
        let back = crate::formats::qcow2::snapshot::read_table(&file, 0, 1, None)
            .unwrap()
            .snapshots;
        assert_eq!(back[0].info.vm_state_size, 5);
        assert_eq!(back[0].disk_size, Some(20 << 20));
        assert_eq!(back[0].info.icount, None);
        // Extra data past the fields QEMU knows is kept.
        let mut long = s.clone();
        long.extra = (0..32).collect();
        assert_eq!(&long.with_full_extra(1).extra[24..], &long.extra[24..]);
    }
}
