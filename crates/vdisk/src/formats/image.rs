//! An open image: its format's driver, the name it was opened by and the chain below it.

use std::sync::Arc;

use super::driver::Driver;
use super::registry::Format;
use super::stack::Layout;
use crate::blockdev::{BlockDev, BlockStatus, StartedRead, StartedWrite};
use crate::error::{Error, Result};
use crate::storage::{BlkdebugRules, IoType, WriteHint};

/// An open image: the driver of its format, its name (QEMU's: the path of its file, the URL
/// of its NBD export, or `json:` and its options; derived from the image above it in a backing
/// chain the way QEMU spells it), its file node, and the image the driver reads as its backing
/// file, if any. The name opens the same image again.
pub struct Image {
    pub filename: String,
    format: Format,
    driver: Box<dyn Driver>,
    backing: Option<Arc<Image>>,
    file_node: Option<FileNode>,
    probed: bool,
    /// The data layout the image sits in (qcow2 on seqlog), whose disk is its storage.
    /// Declared after `driver`, so that the image is dropped (and flushes) first.
    layout: Option<Layout>,
    /// QEMU's blkdebug over the whole image (`driver=blkdebug,image.driver=qcow2`): requests
    /// fail by its rules before they reach the format.
    filter: Option<BlkdebugRules>,
}

/// The protocol node under an image's format, as `qemu-img info` lists it.
#[derive(Debug, Clone)]
pub struct FileNode {
    pub name: String,
    /// The protocol driver: "file", "nbd", "null-co".
    pub driver: &'static str,
}

impl FileNode {
    pub(crate) fn new(name: &str, driver: &'static str) -> FileNode {
        FileNode {
            name: name.to_string(),
            driver,
        }
    }
}

impl Image {
    pub(crate) fn new(
        filename: &str,
        format: Format,
        driver: Box<dyn Driver>,
        backing: Option<Arc<Image>>,
        file_node: Option<FileNode>,
        probed: bool,
        layout: Option<Layout>,
    ) -> Image {
        Image {
            filename: filename.to_string(),
            format,
            driver,
            backing,
            file_node,
            probed,
            layout,
            filter: None,
        }
    }

    /// Puts a blkdebug node's rules over the image.
    pub(crate) fn set_filter(&mut self, rules: BlkdebugRules) {
        self.filter = Some(rules);
    }

    /// Fails a request of `kind` if the image's blkdebug rules say so.
    fn check(&self, kind: IoType, offset: u64, len: u64) -> Result<()> {
        match &self.filter {
            None => Ok(()),
            Some(rules) => rules.check(kind, offset, len).map_err(|source| Error::Io {
                context: String::new(),
                source,
            }),
        }
    }

    /// The data layout the image sits in, if any (see `formats/stack.rs`).
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// Whether the format was probed from the file's contents rather than named (`-f`, a
    /// `driver` option, the image above naming its backing file's format).
    pub fn probed(&self) -> bool {
        self.probed
    }

    /// The protocol node under the format; `None` for a protocol node opened as the image
    /// itself (`"driver": "file"`), which has no child.
    pub fn file_node(&self) -> Option<&FileNode> {
        self.file_node.as_ref()
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The image's driver, for what not every format has (see [`Driver`]).
    pub fn driver(&self) -> &dyn Driver {
        &*self.driver
    }

    pub fn driver_mut(&mut self) -> &mut dyn Driver {
        &mut *self.driver
    }

    /// The image below this one in its backing chain.
    pub fn backing(&self) -> Option<&Arc<Image>> {
        self.backing.as_ref()
    }

    /// Makes everything written durable and the image consistent on disk.
    pub fn close(&self) -> Result<()> {
        self.driver.close()?;
        match &self.layout {
            Some(layout) => layout.driver.close(),
            None => Ok(()),
        }
    }

    /// The storage that holds the image: the file, under any data layout.
    pub fn file(&self) -> &Arc<dyn crate::storage::Storage> {
        match &self.layout {
            Some(layout) => layout.driver.file(),
            None => self.driver.file(),
        }
    }

    /// The name of the file guest data lives in: the image's protocol node (named as the
    /// image is, except where QEMU names a format over it by `json:`, as over RBD), or its
    /// external data file.
    pub fn data_filename(&self) -> &str {
        let file = self.file_node.as_ref().map(|f| f.name.as_str());
        self.driver
            .data_file_name()
            .or(file)
            .unwrap_or(&self.filename)
    }

    /// The format's counters (all zero for formats that allocate nothing).
    pub fn counters(&self) -> crate::counters::CountersSnapshot {
        self.driver.counters()
    }

    /// The format's own counters ([`Driver::format_stats`]), and those of the layout under it.
    pub fn format_stats(&self) -> Vec<crate::counters::FormatStat> {
        let mut stats = self.driver.format_stats();
        if let Some(layout) = &self.layout {
            stats.extend(layout.driver.format_stats());
        }
        stats
    }
}

impl BlockDev for Image {
    fn size(&self) -> u64 {
        self.driver.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(IoType::Read, offset, buf.len() as u64)?;
        self.driver.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.check(IoType::Write, offset, buf.len() as u64)?;
        self.driver.write(offset, buf)
    }
    fn write_hinted(&self, offset: u64, buf: &[u8], hint: WriteHint) -> Result<()> {
        self.check(IoType::Write, offset, buf.len() as u64)?;
        self.driver.write_hinted(offset, buf, hint)
    }
    fn flush(&self) -> Result<()> {
        self.check(IoType::Flush, 0, 0)?;
        self.driver.flush()
    }
    fn write_fua(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.check(IoType::Write, offset, buf.len() as u64)?;
        self.driver.write_fua(offset, buf)
    }
    fn start_write(&self, offset: u64, data: &[u8]) -> Result<Option<StartedWrite<'_>>> {
        // Filtered requests take the synchronous path, where the rules are checked.
        if self.filter.is_some() {
            return Ok(None);
        }
        self.driver.start_write(offset, data)
    }
    fn finish_write(&self, started: StartedWrite<'_>, outcome: Result<()>) -> Result<()> {
        self.driver.finish_write(started, outcome)
    }
    fn start_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<StartedRead<'_>>> {
        if self.filter.is_some() {
            return Ok(None);
        }
        self.driver.start_read(offset, buf)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check(IoType::Discard, offset, len)?;
        self.driver.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check(IoType::WriteZeroes, offset, len)?;
        self.driver.write_zeroes(offset, len)
    }
    fn write_zeroes_fast(&self, offset: u64, len: u64) -> Result<()> {
        self.check(IoType::WriteZeroes, offset, len)?;
        self.driver.write_zeroes_fast(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<BlockStatus> {
        self.check(IoType::BlockStatus, offset, len)?;
        self.driver.block_status(offset, len)
    }
    fn set_size(&self, size: u64) -> Result<()> {
        self.driver.set_size(size)
    }
}
