//! Creating qcow2 images, with QEMU's defaults, option checks and layout.
//!
//! Layout, as `qemu-img create` lays it out: the header in cluster 0, the refcount table from
//! cluster 1, the refcount blocks after it, then the L1 table; with preallocation the first L2
//! table, then all data clusters in one contiguous run, then the other L2 tables. Every cluster written is counted in the refcount
//! blocks written here, so a new image passes `qemu-img check` without leaks.

use super::header::{
    Compression, Header, AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS, CRYPT_AES, CRYPT_LUKS,
    INCOMPAT_COMPRESSION, INCOMPAT_DATA_FILE, INCOMPAT_EXTL2, MAX_L1_BYTES,
};
use super::l2::OFLAG_COPIED;
use super::refcount;
use crate::crypto::luks::{Luks, Params};
use crate::error::{Error, IoContext, Result};
use crate::formats::prealloc::{preallocate, Preallocation};
use crate::storage::Storage;
use crate::storage::WriteHint;

/// The options of `qemu-img create -f qcow2`, with its defaults.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub size: u64,
    pub cluster_size: u64,
    /// 2 for compat=0.10, 3 for compat=1.1.
    pub version: u32,
    pub lazy_refcounts: bool,
    pub extended_l2: bool,
    pub refcount_bits: u64,
    pub preallocation: Preallocation,
    pub compression: Compression,
    pub data_file: Option<String>,
    pub data_file_raw: bool,
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    /// Encryption of the data clusters (`encrypt.format=luks|aes`, `encryption=on`).
    pub encryption: Option<Encryption>,
}

/// How a new image is encrypted.
#[derive(Clone)]
pub enum Encryption {
    /// LUKS (`crypt_method` 2): its parameters and the password (the secret's bytes).
    Luks { params: Params, secret: Vec<u8> },
    /// QEMU's legacy AES (`crypt_method` 1), which qemu-img still creates: there is no header
    /// to write (the key is the password itself), so only the header's method says it.
    Aes,
}

impl Encryption {
    /// The bytes of the LUKS header's clusters (0 for AES, which has none).
    fn header_len(&self) -> u64 {
        match self {
            Encryption::Luks { params, .. } => params.region_len(),
            Encryption::Aes => 0,
        }
    }
}

impl std::fmt::Debug for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Encryption::Luks { params, .. } => f
                .debug_struct("Luks")
                .field("params", params)
                .finish_non_exhaustive(),
            Encryption::Aes => f.write_str("Aes"),
        }
    }
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            size: 0,
            cluster_size: 65536,
            version: 3,
            lazy_refcounts: false,
            extended_l2: false,
            refcount_bits: 16,
            preallocation: Preallocation::Off,
            compression: Compression::Zlib,
            data_file: None,
            data_file_raw: false,
            backing_file: None,
            backing_format: None,
            encryption: None,
        }
    }
}

impl CreateOptions {
    /// Refuses combinations QEMU refuses, with QEMU's messages, in the order its
    /// bdrv_img_create and qcow2_co_create check them.
    pub fn validate(&self) -> Result<()> {
        if self.backing_file.is_some() && self.backing_format.is_none() {
            return Err(Error::invalid(
                "Backing file specified without backing format",
            ));
        }
        let v3_only = |what: &str| {
            Error::invalid(format!(
                "{what} only supported with compatibility level 1.1 and above (use version=v3 \
                 or greater)"
            ))
        };
        if self.extended_l2 && self.version < 3 {
            return Err(v3_only("Extended L2 entries are"));
        }
        let cs = self.cluster_size;
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            return Err(Error::invalid(
                "Cluster size must be a power of two between 512 and 2048k",
            ));
        }
        if self.extended_l2 && cs < 16384 {
            return Err(Error::invalid(
                "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
            ));
        }
        // Preallocated clusters would read as zero and hide the backing file; only subclusters
        // can be allocated and still unallocated.
        if self.backing_file.is_some()
            && self.preallocation != Preallocation::Off
            && !self.extended_l2
        {
            return Err(Error::invalid(
                "Backing file and preallocation can only be used at the same time if extended_l2 \
                 is on",
            ));
        }
        if self.backing_format.is_some() && self.backing_file.is_none() {
            return Err(Error::invalid(
                "Backing format cannot be used without backing file",
            ));
        }
        if self.lazy_refcounts && self.version < 3 {
            return Err(v3_only("Lazy refcounts"));
        }
        if !self.refcount_bits.is_power_of_two() || self.refcount_bits > 64 {
            return Err(Error::invalid(
                "Refcount width must be a power of two and may not exceed 64 bits",
            ));
        }
        if self.refcount_bits != 16 && self.version < 3 {
            return Err(Error::invalid(
                "Different refcount widths than 16 bits require compatibility level 1.1 or \
                 above (use version=v3 or greater)",
            ));
        }
        if self.data_file_raw && self.data_file.is_none() {
            return Err(Error::invalid("data-file-raw requires data-file"));
        }
        if self.data_file_raw && self.backing_file.is_some() {
            return Err(Error::invalid(
                "Backing file and data-file-raw cannot be used at the same time",
            ));
        }
        if self.data_file.is_some() && self.version < 3 {
            return Err(v3_only("External data files are"));
        }
        if self.compression != Compression::Zlib && self.version < 3 {
            return Err(Error::invalid(
                "Non-zlib compression type is only supported with compatibility level 1.1 and \
                 above (use version=v3 or greater)",
            ));
        }
        Ok(())
    }
}

impl CreateOptions {
    /// The length of the image file these options make (its metadata and the data clusters it
    /// preallocates, rounded up to whole clusters), or QEMU's refusal of a size the format
    /// cannot hold. It needs no file, so callers learn before cutting an existing one whether
    /// [`create`] can succeed. It refuses the options [`CreateOptions::validate`] refuses.
    pub fn file_len(&self) -> Result<u64> {
        self.validate()?;
        // QEMU takes the size as an int64_t; a size rounded up past it is negative there.
        if self.size > i64::MAX as u64 {
            return Err(Error::invalid(
                "Could not resize image: Image size cannot be negative",
            ));
        }
        let per_block = refcount::entries_per_block(
            self.cluster_size.trailing_zeros(),
            self.refcount_bits.trailing_zeros(),
        );
        let l = layout(self, per_block)?;
        Ok(l.total * self.cluster_size)
    }
}

/// Where everything of a new image goes, in clusters.
struct Layout {
    refcount_table: u64,
    refcount_table_clusters: u64,
    refcount_blocks: u64,
    l1: u64,
    l1_entries: u64,
    /// The LUKS header's first cluster and its length in bytes (0: not encrypted).
    crypt: u64,
    crypt_len: u64,
    /// First cluster of the preallocated L2 tables and data, and their count.
    prealloc: u64,
    l2_tables: u64,
    data_clusters: u64,
    /// Clusters that get a refcount of 1.
    total: u64,
}

fn layout(o: &CreateOptions, per_block: u64) -> Result<Layout> {
    let cs = o.cluster_size;
    let l2_entries = cs / if o.extended_l2 { 16 } else { 8 };
    let l1_entries = o.size.div_ceil(cs * l2_entries);
    if l1_entries * 8 > MAX_L1_BYTES {
        // qemu-img's words for a size no L1 table can map (it says the same of EFBIG).
        return Err(Error::invalid(
            "The image size is too large for file format 'qcow2' (try using a larger cluster \
             size)",
        ));
    }
    let l1_clusters = (l1_entries * 8).div_ceil(cs);
    let raw_data = o.data_file_raw;
    let prealloc = o.preallocation != Preallocation::Off || raw_data;
    let l2_tables = if prealloc { l1_entries } else { 0 };
    // Data in an external file needs no refcounts in the image.
    let data_clusters = if prealloc && o.data_file.is_none() {
        o.size.div_ceil(cs)
    } else {
        0
    };
    // As QEMU: the LUKS header's clusters follow the L1 table.
    let crypt_len = o.encryption.as_ref().map_or(0, Encryption::header_len);
    let crypt_clusters = crypt_len.div_ceil(cs);
    let fixed = 1 + l1_clusters + crypt_clusters + l2_tables + data_clusters;
    // The refcount structures count themselves: grow them until they cover everything.
    let (mut table, mut blocks) = (1, 1);
    loop {
        let total = fixed + table + blocks;
        let need_blocks = total.div_ceil(per_block);
        let need_table = (need_blocks * 8).div_ceil(cs);
        if need_blocks <= blocks && need_table <= table {
            break;
        }
        blocks = blocks.max(need_blocks);
        table = table.max(need_table);
    }
    let l1 = 1 + table + blocks;
    Ok(Layout {
        refcount_table: 1,
        refcount_table_clusters: table,
        refcount_blocks: blocks,
        l1,
        l1_entries,
        crypt: l1 + l1_clusters,
        crypt_len,
        prealloc: l1 + l1_clusters + crypt_clusters,
        l2_tables,
        data_clusters,
        total: fixed + table + blocks,
    })
}

/// The header a new image starts with.
fn new_header(o: &CreateOptions, l: &Layout) -> Header {
    let cs = o.cluster_size;
    let mut incompatible = 0;
    if o.extended_l2 {
        incompatible |= INCOMPAT_EXTL2;
    }
    if o.data_file.is_some() {
        incompatible |= INCOMPAT_DATA_FILE;
    }
    if o.compression != Compression::Zlib {
        incompatible |= INCOMPAT_COMPRESSION;
    }
    Header {
        version: o.version,
        backing_file: o.backing_file.clone(),
        backing_format: o.backing_format.clone(),
        cluster_bits: cs.trailing_zeros(),
        size: o.size,
        l1_size: l.l1_entries as u32,
        l1_table_offset: l.l1 * cs,
        refcount_table_offset: l.refcount_table * cs,
        refcount_table_clusters: l.refcount_table_clusters as u32,
        nb_snapshots: 0,
        snapshots_offset: 0,
        incompatible,
        compatible: if o.lazy_refcounts {
            COMPAT_LAZY_REFCOUNTS
        } else {
            0
        },
        autoclear: if o.data_file_raw {
            AUTOCLEAR_DATA_FILE_RAW
        } else {
            0
        },
        refcount_order: o.refcount_bits.trailing_zeros(),
        header_length: if o.version >= 3 { 112 } else { 72 },
        compression: o.compression,
        data_file: o.data_file.clone(),
        crypt_method: match o.encryption {
            Some(Encryption::Luks { .. }) => CRYPT_LUKS,
            Some(Encryption::Aes) => CRYPT_AES,
            None => 0,
        },
        crypt_header: (l.crypt_len > 0).then_some((l.crypt * cs, l.crypt_len)),
        feature_names: Vec::new(),
        unknown_extensions: Vec::new(),
    }
}

/// Writes a new qcow2 image into the empty `file`. `data` is the external data file, when the
/// options name one.
pub fn create(file: &dyn Storage, data: Option<&dyn Storage>, o: &CreateOptions) -> Result<()> {
    o.validate()?;
    let cs = o.cluster_size;
    let order = o.refcount_bits.trailing_zeros();
    let per_block = refcount::entries_per_block(cs.trailing_zeros(), order);
    let l = layout(o, per_block)?;
    let io = |what: &'static str| move || format!("writing the new image's {what}");

    // The header is written as a whole cluster, as QEMU writes it: the file's allocation then
    // matches QEMU's, which its metadata-preallocation heuristic (and so `map`) depends on.
    let mut header = new_header(o, &l).to_bytes()?;
    header.resize(cs as usize, 0);
    file.write_at_hinted(0, &header, WriteHint::Metadata)
        .context(io("header"))?;

    let mut table = vec![0u8; (l.refcount_table_clusters * cs) as usize];
    for b in 0..l.refcount_blocks {
        let at = (l.refcount_table + l.refcount_table_clusters + b) * cs;
        table[(b * 8) as usize..(b * 8 + 8) as usize].copy_from_slice(&at.to_be_bytes());
    }
    file.write_at_hinted(l.refcount_table * cs, &table, WriteHint::Metadata)
        .context(io("refcount table"))?;
    let mut blocks = vec![0u8; (l.refcount_blocks * cs) as usize];
    for cluster in 0..l.total {
        refcount::set(&mut blocks, cluster, order, 1);
    }
    let blocks_at = (l.refcount_table + l.refcount_table_clusters) * cs;
    file.write_at_hinted(blocks_at, &blocks, WriteHint::Metadata)
        .context(io("refcount blocks"))?;

    let first_data = l.prealloc + 1;
    if l.data_clusters > 0 {
        let end = (first_data + l.data_clusters) * cs;
        preallocate(file, first_data * cs, end, o.preallocation)?;
    }
    let l2_cluster = |t: u64| {
        if t == 0 {
            l.prealloc
        } else {
            first_data + l.data_clusters + t - 1
        }
    };
    let mut l1 = vec![0u8; (l.l1_entries * 8) as usize];
    let entry_bytes = if o.extended_l2 { 16 } else { 8 };
    let entries_per_l2 = cs / entry_bytes;
    for t in 0..l.l2_tables {
        l1[(t * 8) as usize..(t * 8 + 8) as usize]
            .copy_from_slice(&((l2_cluster(t) * cs) | OFLAG_COPIED).to_be_bytes());
        let mut l2 = vec![0u8; cs as usize];
        for i in 0..entries_per_l2 {
            let guest = (t * entries_per_l2 + i) * cs;
            if guest >= o.size {
                break;
            }
            // Data in an external file sits at its guest offset.
            let host = match o.data_file {
                Some(_) => guest,
                None => (first_data + t * entries_per_l2 + i) * cs,
            };
            // With extended L2 entries QEMU preallocates the host cluster but leaves every
            // subcluster unallocated (bitmap 0): reads still go to the backing file.
            let at = (i * entry_bytes) as usize;
            l2[at..at + 8].copy_from_slice(&(host | OFLAG_COPIED).to_be_bytes());
        }
        file.write_at_hinted(l2_cluster(t) * cs, &l2, WriteHint::Metadata)
            .context(io("L2 tables"))?;
    }
    file.write_at_hinted(l.l1 * cs, &l1, WriteHint::Metadata)
        .context(io("L1 table"))?;
    if let Some(Encryption::Luks { params, secret }) = &o.encryption {
        let (mut luks, _) = Luks::create(params, secret)?;
        luks.resize(luks.len().next_multiple_of(cs as usize), 0);
        file.write_at_hinted(l.crypt * cs, &luks, WriteHint::Metadata)
            .context(io("LUKS header"))?;
    }
    if let Some(data) = data {
        data.set_len(0).context(io("data file"))?;
        preallocate(data, 0, o.size, o.preallocation)?;
        data.set_len(o.size).context(io("data file"))?;
    }
    Ok(())
}
