//! `vdisk info`: what `qemu-img info` reports, in its human and JSON forms.

use std::process::ExitCode;

use vdisk::formats::{InfoValue, SnapshotInfo};
use vdisk::{open_image, BlockDev, Format, Image, ImageOptions};

use crate::flags::{Described, ForceShare, ImageFormat, Output};
use crate::open::metadata_options;
use crate::qjson::{self, Dict, Value};
use crate::report::fail;
use crate::text::{size_to_str, snapshot_list};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    described: Described,
    #[arg(short = 'b', long)]
    backing_chain: bool,
    #[command(flatten)]
    share: ForceShare,
    filename: String,
}

pub fn run(a: &Args) -> ExitCode {
    let output = a.described.report.output;
    let chain = a.backing_chain;
    let images = match open_chain(&a.filename, &a.described.image, chain, a.share.force_share) {
        Ok(images) => images,
        Err(e) => return fail(e, 1),
    };
    let infos: Vec<Info> = images.iter().map(Info::of).collect();
    match output {
        Output::Json if chain => {
            let list = Value::Array(infos.iter().map(Info::json).collect());
            println!("{}", qjson::to_pretty(&list));
        }
        Output::Json => println!("{}", qjson::to_pretty(&infos[0].json())),
        Output::Human => {
            let texts: Vec<String> = infos.iter().map(Info::human).collect();
            print!("{}", texts.join("\n"));
        }
    }
    ExitCode::SUCCESS
}

/// Opens the image and, with `chain`, each image below it, one at a time and without its own
/// backing file, as qemu-img does: a broken link fails on the image that is missing. Backing
/// names are resolved against the name the image above was opened by (its path, for a
/// `json:` or `--image-opts` name of a file).
fn open_chain(
    filename: &str,
    named: &ImageFormat,
    chain: bool,
    force_share: bool,
) -> vdisk::Result<Vec<Image>> {
    let mut images: Vec<Image> = Vec::new();
    let mut seen = Vec::new();
    let mut next = Some((filename.to_string(), named.clone()));
    while let Some((name, named)) = next.take() {
        let canonical = std::fs::canonicalize(&name).ok();
        if canonical.is_some() && seen.contains(&canonical) {
            return Err(vdisk::Error::corrupt(format!(
                "Backing file '{name}' creates an infinite loop."
            )));
        }
        seen.push(canonical);
        let opts = ImageOptions {
            no_backing: true,
            data_file_optional: true,
            ..metadata_options(&name, &named, force_share)?
        };
        let image = open_image(&name, &opts)?;
        if chain {
            let backing = image.driver().info().backing;
            next = backing.map(|(file, format)| {
                let path = vdisk::backing_path(&image.filename, &file);
                let named = ImageFormat {
                    format,
                    image_opts: false,
                };
                (path, named)
            });
        }
        images.push(image);
    }
    Ok(images)
}

/// What qemu-img's ImageInfo holds for one image of a chain.
struct Info {
    filename: String,
    format: &'static str,
    virtual_size: u64,
    /// Bytes the file takes on the host; `None` where its protocol cannot tell (NBD).
    actual_size: Option<u64>,
    file_length: u64,
    /// The protocol node under the format (name, driver); `None` for a protocol node opened
    /// as the image.
    file: Option<(String, &'static str)>,
    /// The protocol node's cluster size, where its driver answers `bdrv_get_info` with one
    /// (rbd: the object size).
    file_cluster: Option<u64>,
    /// Snapshots the protocol node keeps itself (RBD's), which QEMU lists under it.
    file_snapshots: Vec<SnapshotInfo>,
    /// Whether QEMU's `bdrv_get_info` answers for the image, which `dirty-flag` comes from:
    /// not for raw over anything but a file, nor for protocols other than file.
    has_info: bool,
    cluster_size: Option<u64>,
    dirty: bool,
    encrypted: bool,
    backing: Option<(String, String, Option<String>)>,
    snapshots: Vec<SnapshotInfo>,
    specific: Option<Specific>,
    /// The data layout under the image (qcow2 on seqlog): its format, its disk's size and
    /// its own information.
    layout: Option<(&'static str, u64, Specific)>,
}

impl Info {
    fn of(image: &Image) -> Info {
        let file_length = image.file().len().unwrap_or(0);
        let file_actual = image.file().allocated_bytes().ok();
        let file = image.file_node().map(|f| (f.name.clone(), f.driver));
        let protocol = file.as_ref().map_or(image.format().name(), |f| f.1);
        let file_cluster = image.file().cluster_size();
        let has_info = matches!(protocol, "file" | "rbd")
            || !(image.format().is_protocol() || image.format() == Format::RAW);
        let mut info = Info {
            filename: image.filename.clone(),
            format: image.format().name(),
            virtual_size: image.size(),
            actual_size: file_actual,
            file_length: file_length.next_multiple_of(512),
            file,
            file_cluster,
            file_snapshots: storage_snapshots(&**image.file()),
            has_info,
            cluster_size: None,
            dirty: false,
            encrypted: false,
            backing: None,
            snapshots: Vec::new(),
            specific: None,
            layout: None,
        };
        let f = image.driver().info();
        // raw passes bdrv_get_info on to its file; a protocol node is the file.
        let file_answers = image.format() == Format::RAW || image.format().is_protocol();
        info.cluster_size = match file_answers {
            true => f.cluster_size.or(file_cluster),
            false => f.cluster_size,
        };
        info.dirty = f.dirty;
        info.encrypted = f.encrypted;
        info.snapshots = image.driver().snapshots();
        // And its snapshot list (RBD's, for raw over RBD).
        if file_answers && info.snapshots.is_empty() {
            info.snapshots = info.file_snapshots.clone();
        }
        info.backing = f.backing.map(|(name, fmt)| {
            let full = vdisk::backing_path(&image.filename, &name);
            (name, full, fmt)
        });
        let specific = |d: Vec<(&str, InfoValue)>| {
            d.into_iter()
                .map(|(k, v)| (k.to_string(), json(v)))
                .collect()
        };
        info.specific = f.specific.map(specific);
        info.layout = image.layout().map(|l| {
            let data = l.driver.info().specific.map_or(Vec::new(), specific);
            (l.format.name(), l.driver.size(), data)
        });
        info
    }

    /// The protocol node under the format, as QEMU describes it.
    fn file_child(&self, name: &str, driver: &'static str) -> Value {
        let mut file = Dict::new();
        file.put("filename", name).put("format", driver);
        protocol_facts(&mut file, driver, self.actual_size);
        file.put("virtual-size", self.file_length);
        if let Some(cs) = self.file_cluster {
            file.put("cluster-size", cs);
        }
        if !self.file_snapshots.is_empty() {
            let snaps = self.file_snapshots.iter().map(snapshot_json).collect();
            file.put("snapshots", Value::Array(snaps));
        }
        file_specific(&mut file, driver);
        file.put("children", Value::Array(Vec::new()));
        let mut child = Dict::new();
        child.put("name", "file").put("info", file.build());
        child.build()
    }

    /// Members are added in the order of QAPI's ImageInfo: QEMU's QDict prints members that
    /// share a hash bucket newest first, so the insertion order decides among them.
    fn json(&self) -> Value {
        let mut d = Dict::new();
        d.put("filename", self.filename.as_str())
            .put("format", self.format);
        if self.file.is_none() {
            protocol_facts(&mut d, self.format, self.actual_size);
        } else {
            if self.has_info {
                d.put("dirty-flag", self.dirty);
            }
            if let Some(size) = self.actual_size {
                d.put("actual-size", size);
            }
        }
        d.put("virtual-size", self.virtual_size);
        if let Some(cs) = self.cluster_size {
            d.put("cluster-size", cs);
        }
        if self.encrypted {
            d.put("encrypted", true);
        }
        if let Some((name, full, fmt)) = &self.backing {
            d.put("backing-filename", name.as_str());
            d.put("full-backing-filename", full.as_str());
            if let Some(fmt) = fmt {
                d.put("backing-filename-format", fmt.as_str());
            }
        }
        if !self.snapshots.is_empty() {
            let snaps = self.snapshots.iter().map(snapshot_json).collect();
            d.put("snapshots", Value::Array(snaps));
        }
        if let Some(spec) = &self.specific {
            let mut fs = Dict::new();
            fs.put("type", self.format)
                .put("data", Value::Dict(spec.clone()));
            d.put("format-specific", fs.build());
        } else if self.file.is_none() {
            file_specific(&mut d, self.format);
        }
        if let Some((format, size, data)) = &self.layout {
            let mut l = Dict::new();
            l.put("format", *format)
                .put("virtual-size", *size)
                .put("data", Value::Dict(data.clone()));
            d.put("data-layout", l.build());
        }
        let children = self
            .file
            .iter()
            .map(|(name, driver)| self.file_child(name, driver));
        d.put("children", Value::Array(children.collect()));
        d.build()
    }

    fn human(&self) -> String {
        let mut s = format!(
            "image: {}\nfile format: {}\nvirtual size: {} ({} bytes)\ndisk size: {}\n",
            self.filename,
            self.format,
            size_to_str(self.virtual_size),
            self.virtual_size,
            disk_size(self.actual_size)
        );
        if self.encrypted {
            s += "encrypted: yes\n";
        }
        if let Some(cs) = self.cluster_size {
            s += &format!("cluster_size: {cs}\n");
        }
        if self.dirty {
            s += "cleanly shut down: no\n";
        }
        if let Some((name, full, fmt)) = &self.backing {
            s += &format!("backing file: {name}");
            if name != full {
                s += &format!(" (actual path: {full})");
            }
            s += "\n";
            if let Some(fmt) = fmt {
                s += &format!("backing file format: {fmt}\n");
            }
        }
        s += &snapshot_list(&self.snapshots);
        if let Some(spec) = &self.specific {
            s += "Format specific information:\n";
            qjson::dump_human(&mut s, 1, &Value::Dict(spec.clone()));
        }
        if let Some((format, size, data)) = &self.layout {
            s += &format!("Data layout: {format}\n    disk size now: {size} bytes\n");
            qjson::dump_human(&mut s, 1, &Value::Dict(data.clone()));
        }
        if let Some((name, driver)) = &self.file {
            s += &format!(
                "Child node '/file':\n    filename: {name}\n    protocol type: {driver}\n    file \
                 length: {} ({} bytes)\n    disk size: {}\n",
                size_to_str(self.file_length),
                self.file_length,
                disk_size(self.actual_size)
            );
            if let Some(cs) = self.file_cluster {
                s += &format!("    cluster_size: {cs}\n");
            }
            for line in snapshot_list(&self.file_snapshots).lines() {
                s += &format!("    {line}\n");
            }
        }
        s
    }
}

/// Format-specific information, as JSON members.
type Specific = Vec<(String, Value)>;

/// The snapshots a storage keeps, as QEMU's rbd driver describes them: the name as id and
/// tag, the size as the VM state size, no date, clock or instructions.
fn storage_snapshots(storage: &dyn vdisk::storage::Storage) -> Vec<SnapshotInfo> {
    let snapshot = |s: vdisk::storage::StorageSnapshot| SnapshotInfo {
        id: s.name.clone(),
        name: s.name,
        date_sec: 0,
        date_nsec: 0,
        vm_clock_nsec: 0,
        vm_state_size: s.size,
        icount: Some(0),
    };
    storage.snapshots().into_iter().map(snapshot).collect()
}

/// "disk size" as QEMU prints it.
fn disk_size(bytes: Option<u64>) -> String {
    bytes.map_or("unavailable".into(), size_to_str)
}

/// What QEMU says of a protocol node's state: the file and rbd drivers answer `bdrv_get_info`
/// (a dirty flag); NBD and RBD cannot tell their disk usage.
fn protocol_facts(d: &mut Dict, driver: &str, actual_size: Option<u64>) {
    if matches!(driver, "file" | "rbd") {
        d.put("dirty-flag", false);
    }
    if let Some(size) = actual_size {
        d.put("actual-size", size);
    }
}

/// The file and rbd drivers' (empty) format-specific information; other protocols have none.
fn file_specific(d: &mut Dict, driver: &'static str) {
    if matches!(driver, "file" | "rbd") {
        let mut specific = Dict::new();
        specific
            .put("type", driver)
            .put("data", Dict::new().build());
        d.put("format-specific", specific.build());
    }
}

/// A value of the format-specific information as JSON.
fn json(v: InfoValue) -> Value {
    match v {
        InfoValue::Bool(b) => b.into(),
        InfoValue::Number(n) => n.into(),
        InfoValue::Text(t) => t.into(),
        InfoValue::List(l) => Value::Array(l.into_iter().map(json).collect()),
        InfoValue::Dict(d) => {
            Value::Dict(d.into_iter().map(|(k, v)| (k.into(), json(v))).collect())
        }
    }
}

fn snapshot_json(sn: &SnapshotInfo) -> Value {
    let mut d = Dict::new();
    if let Some(icount) = sn.icount {
        d.put("icount", icount);
    }
    d.put("vm-clock-nsec", (sn.vm_clock_nsec % 1_000_000_000) as u32)
        .put("name", sn.name.as_str())
        .put("date-sec", sn.date_sec)
        .put("date-nsec", sn.date_nsec)
        .put("vm-clock-sec", sn.vm_clock_nsec / 1_000_000_000)
        .put("id", sn.id.as_str())
        .put("vm-state-size", sn.vm_state_size);
    d.build()
}
