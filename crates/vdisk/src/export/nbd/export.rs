//! What the server exports: a named [`BlockDev`] and how it is offered (read-only, sizes,
//! metadata contexts), with the counters of the requests served from it.

use std::sync::Arc;

use super::proto::*;
use super::stats::RequestStats;
use crate::blockdev::BlockDev;
use crate::cache::CacheMode;
use crate::export::log::Throttle;
use crate::formats::Image;
use crate::io::IoCounters;

/// How an export is offered to clients.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The name clients ask for (`""` is the default export).
    pub name: String,
    /// Shown by `nbdinfo --list` and in NBD_OPT_LIST.
    pub description: Option<String>,
    /// Refuse writes (NBD_FLAG_READ_ONLY; writes fail with EPERM).
    pub read_only: bool,
    /// The size at which requests are efficient (NBD_INFO_BLOCK_SIZE's preferred size): the
    /// caller knows the format, the export does not. A power of two, 512 to 32 MiB.
    pub preferred_block: u32,
    /// Offer `qemu:allocation-depth` (meaningful for images with backing files).
    pub allocation_depth: bool,
}

impl ExportOptions {
    pub fn new(name: impl Into<String>) -> ExportOptions {
        ExportOptions {
            name: name.into(),
            description: None,
            read_only: false,
            preferred_block: 4096,
            allocation_depth: false,
        }
    }
}

/// A disk offered over NBD.
pub struct Export {
    opts: ExportOptions,
    dev: Arc<dyn BlockDev>,
    /// Kept for its storage and engine counters (`vdisk stats`), when the disk is an image.
    image: Option<Arc<Image>>,
    pub(crate) stats: RequestStats,
    /// What the connections' I/O queues did for this export.
    pub(crate) io: Arc<IoCounters>,
    /// Paces the log lines of failed requests.
    pub(crate) failures: Throttle,
}

impl Export {
    /// Exports any disk.
    pub fn new(dev: Arc<dyn BlockDev>, opts: ExportOptions) -> Export {
        let mut opts = opts;
        opts.preferred_block = opts.preferred_block.clamp(512, MAX_PAYLOAD);
        if !opts.preferred_block.is_power_of_two() {
            opts.preferred_block = opts.preferred_block.next_power_of_two().min(MAX_PAYLOAD);
        }
        Export {
            opts,
            dev,
            image: None,
            stats: RequestStats::default(),
            io: Arc::default(),
            failures: Throttle::default(),
        }
    }

    /// Exports an image used under cache mode `mode` (whose page-cache part was chosen when
    /// the image was opened); its storage and engine counters then appear in the metrics.
    pub fn from_image(image: Arc<Image>, mode: CacheMode, opts: ExportOptions) -> Export {
        Export {
            image: Some(image.clone()),
            ..Export::new(mode.serve(image), opts)
        }
    }

    pub fn name(&self) -> &str {
        &self.opts.name
    }

    pub fn options(&self) -> &ExportOptions {
        &self.opts
    }

    pub fn dev(&self) -> &dyn BlockDev {
        &*self.dev
    }

    pub fn image(&self) -> Option<&Arc<Image>> {
        self.image.as_ref()
    }

    pub fn size(&self) -> u64 {
        self.dev.size()
    }

    /// Transmission flags, as qemu-nbd sets them. Multi-conn is safe because every connection
    /// goes to the same engine: a flush on one makes writes acknowledged on all durable.
    pub fn flags(&self, structured: bool) -> u16 {
        let mut f = FLAG_HAS_FLAGS
            | FLAG_SEND_FLUSH
            | FLAG_SEND_FUA
            | FLAG_SEND_CACHE
            | FLAG_CAN_MULTI_CONN;
        if self.opts.read_only {
            f |= FLAG_READ_ONLY;
        } else {
            f |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
        }
        if structured {
            f |= FLAG_SEND_DF;
        }
        f
    }

    /// NBD_INFO_BLOCK_SIZE: minimum 1 (any alignment is served; the engine handles partial
    /// sectors), the preferred size, and the 32 MiB payload limit.
    pub fn block_sizes(&self) -> [u32; 3] {
        [1, self.opts.preferred_block, MAX_PAYLOAD]
    }
}

/// The exports of one server, looked up by name.
pub struct Exports {
    list: Vec<Arc<Export>>,
}

impl Exports {
    /// Fails when two exports share a name.
    pub fn new(list: Vec<Export>) -> Result<Exports, String> {
        let list: Vec<Arc<Export>> = list.into_iter().map(Arc::new).collect();
        for (i, e) in list.iter().enumerate() {
            if list[..i].iter().any(|o| o.name() == e.name()) {
                return Err(format!("two exports are named '{}'", e.name()));
            }
        }
        Ok(Exports { list })
    }

    /// The export called `name`. The empty name is the default export, which is only an
    /// export named `""`: like qemu-nbd, a server whose exports all have names has none.
    pub fn find(&self, name: &[u8]) -> Option<&Arc<Export>> {
        self.list.iter().find(|e| e.name().as_bytes() == name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Export>> {
        self.list.iter()
    }

    pub fn list(&self) -> &[Arc<Export>] {
        &self.list
    }
}
