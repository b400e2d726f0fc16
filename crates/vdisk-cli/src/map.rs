//! `vdisk map`: the extents `qemu-img map` prints, merged by its rules.

use std::process::ExitCode;

use vdisk::{open_image, BlockDev, BlockStatus, Image};

use crate::flags::{Described, ForceShare, Output};
use crate::open::metadata_options;
use crate::report::{fail, QemuMessage};
use crate::size::cvtnum;
use crate::text::hex16;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    described: Described,
    /// Sizes as everywhere: suffixes k to E, fractions with one, 0x hex. Like getopt, the
    /// flag takes the next word even if it starts with "-" (which is then out of range).
    #[arg(long, short = 's', value_parser = start_offset, allow_hyphen_values = true)]
    start_offset: Option<u64>,
    #[arg(long, short = 'l', value_parser = max_length, allow_hyphen_values = true)]
    max_length: Option<u64>,
    #[command(flatten)]
    share: ForceShare,
    filename: String,
}

fn start_offset(text: &str) -> Result<u64, QemuMessage> {
    cvtnum("start offset", text).map_err(QemuMessage)
}

fn max_length(text: &str) -> Result<u64, QemuMessage> {
    cvtnum("max length", text).map_err(QemuMessage)
}

/// One printed extent: a block status plus the file its offset refers to.
#[derive(Debug, Clone)]
struct Entry {
    start: u64,
    length: u64,
    status: BlockStatus,
    filename: Option<String>,
}

impl Entry {
    /// qemu-img's `entry_mergeable`: same flags and file, and host offsets that continue.
    fn continues_with(&self, next: &Entry) -> bool {
        let (a, b) = (&self.status, &next.status);
        self.length > 0
            && (a.zero, a.data, a.compressed, a.depth, a.present)
                == (b.zero, b.data, b.compressed, b.depth, b.present)
            && self.filename == next.filename
            && match (a.offset, b.offset) {
                (Some(x), Some(y)) => x + self.length == y,
                (None, None) => true,
                _ => false,
            }
    }

    fn json(&self) -> String {
        let s = &self.status;
        let mut out = format!(
            "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \"data\": {}, \"compressed\": {}",
            self.start, self.length, s.depth, s.present, s.zero, s.data, s.compressed
        );
        if let Some(o) = s.offset {
            out += &format!(", \"offset\": {o}");
        }
        out + "}"
    }
}

fn entry_at(image: &Image, offset: u64, len: u64) -> vdisk::Result<Entry> {
    let status = image.block_status(offset, len)?;
    let filename = status.offset.map(|_| {
        let mut layer = image;
        for _ in 0..status.depth {
            layer = layer.backing().map(|b| &**b).unwrap_or(layer);
        }
        layer.data_filename().to_string()
    });
    Ok(Entry {
        start: offset,
        length: status.len,
        status,
        filename,
    })
}

pub fn run(a: &Args) -> ExitCode {
    let filename = &a.filename;
    let (output, start, max_length) = (a.described.report.output, a.start_offset, a.max_length);
    let force_share = a.share.force_share;
    let image = match metadata_options(filename, &a.described.image, force_share)
        .and_then(|o| open_image(filename, &o))
    {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    let start = start.unwrap_or(0);
    let mut len = image.size();
    if let Some(max) = max_length {
        len = len.min(start.saturating_add(max));
    }
    let mut printer = Printer {
        output,
        first: true,
    };
    printer.begin();
    let empty = BlockStatus {
        len: 0,
        depth: 0,
        present: false,
        data: false,
        zero: false,
        compressed: false,
        offset: None,
    };
    let mut curr = Entry {
        start,
        length: 0,
        status: empty,
        filename: None,
    };
    while curr.start + curr.length < len {
        let off = curr.start + curr.length;
        let mut next = match entry_at(&image, off, len - off) {
            Ok(e) => e,
            Err(e) => {
                printer.abort();
                return fail(format!("Could not read file metadata: {e}"), 1);
            }
        };
        if curr.continues_with(&next) {
            curr.length += next.length;
            continue;
        }
        if curr.length > 0 {
            if let Err(code) = printer.entry(&curr, Some(&mut next)) {
                return code;
            }
        }
        curr = next;
    }
    if let Err(code) = printer.entry(&curr, None) {
        return code;
    }
    printer.end();
    ExitCode::SUCCESS
}

struct Printer {
    output: Output,
    first: bool,
}

impl Printer {
    fn begin(&self) {
        match self.output {
            Output::Human => println!("{:<16}{:<16}{:<16}File", "Offset", "Length", "Mapped to"),
            Output::Json => print!("["),
        }
    }

    /// qemu-img's `dump_map_entry`. Human output lists stored data only, and may fold the
    /// next entry into "not data" so that runs of unprinted extents merge.
    fn entry(&mut self, e: &Entry, next: Option<&mut Entry>) -> Result<(), ExitCode> {
        match self.output {
            Output::Json => {
                if !self.first {
                    println!(",");
                }
                self.first = false;
                print!("{}", e.json());
            }
            Output::Human => {
                let s = &e.status;
                if s.data && s.offset.is_none() {
                    return Err(fail(
                        "File contains external, encrypted or compressed clusters.",
                        1,
                    ));
                }
                if let (true, false, Some(o)) = (s.data, s.zero, s.offset) {
                    let file = e.filename.as_deref().unwrap_or("");
                    println!("{}{}{}{}", hex16(e.start), hex16(e.length), hex16(o), file);
                }
                if let Some(n) = next {
                    if !n.status.data || n.status.zero {
                        n.status.data = false;
                        n.status.zero = true;
                    }
                }
            }
        }
        Ok(())
    }

    fn abort(&self) {
        if self.output == Output::Json && !self.first {
            println!();
        }
    }

    fn end(&self) {
        if self.output == Output::Json {
            println!("]");
        }
    }
}
