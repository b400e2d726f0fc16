//! A guest's disk: an image that a `vdisk serve` process exports, and the QEMU arguments that
//! attach it, for each transport vdisk serves (so every scenario runs over each of them). The
//! same disk can be served by qemu-storage-daemon instead, the peer vdisk is compared with.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::peers::Peers;

/// How QEMU reaches the disks of a run.
#[derive(Clone, Copy, Debug)]
pub enum Transport {
    /// QEMU's NBD client on a unix socket, under a virtio-blk device QEMU emulates.
    Nbd,
    /// vdisk is the virtio-blk device (`vhost-user-blk-pci`), with this many virtqueues.
    VhostUserBlk { num_queues: u16 },
}

/// One exported disk: where its socket is, and how each side is told about it.
#[derive(Clone, Debug)]
pub enum Disk {
    Nbd { socket: PathBuf },
    VhostUserBlk { socket: PathBuf, num_queues: u16 },
}

impl Disk {
    pub fn new(transport: Transport, socket: PathBuf) -> Disk {
        match transport {
            Transport::Nbd => Disk::Nbd { socket },
            Transport::VhostUserBlk { num_queues } => Disk::VhostUserBlk { socket, num_queues },
        }
    }

    /// What `vdisk serve IMG` needs besides the image to export this disk.
    fn serve_args(&self) -> Vec<OsString> {
        match self {
            Disk::Nbd { socket } => {
                let mut unix = OsString::from("unix:");
                unix.push(socket);
                vec!["--nbd".into(), unix]
            }
            Disk::VhostUserBlk { socket, num_queues } => vec![
                "--vhost-user-blk".into(),
                socket.into(),
                "--num-queues".into(),
                num_queues.to_string().into(),
            ],
        }
    }

    /// Whether QEMU must give the guest shareable memory: a vhost-user back end maps it.
    pub fn needs_shared_memory(&self) -> bool {
        match self {
            Disk::Nbd { .. } => false,
            Disk::VhostUserBlk { .. } => true,
        }
    }

    /// The virtqueues the guest's driver gets (it maps them to its CPUs).
    pub fn queues(&self) -> u16 {
        match self {
            Disk::Nbd { .. } => 1,
            Disk::VhostUserBlk { num_queues, .. } => *num_queues,
        }
    }

    /// The QEMU arguments of the guest's `index`th disk. Its PCI slot follows the index, so
    /// that the guest names the disks vda, vdb, ... in this order.
    pub fn qemu_args(&self, index: usize) -> Vec<String> {
        let id = format!("d{index}");
        let addr = format!("addr={:#x}", 0x10 + index);
        match self {
            // discard=unmap: pass the guest's discards on as NBD trims (QEMU drops them
            // otherwise); cache.direct=on: no host page cache between guest and server.
            Disk::Nbd { socket } => vec![
                "-blockdev".into(),
                format!(
                    "driver=nbd,node-name={id},server.type=unix,server.path={},\
                     discard=unmap,cache.direct=on",
                    socket.display()
                ),
                "-device".into(),
                format!("virtio-blk-pci,drive={id},num-queues=1,{addr}"),
            ],
            // The device's features (discard, write zeroes, ...) are the back end's to offer.
            Disk::VhostUserBlk { socket, num_queues } => vec![
                "-chardev".into(),
                format!("socket,id={id},path={}", socket.display()),
                "-device".into(),
                format!("vhost-user-blk-pci,chardev={id},num-queues={num_queues},{addr}"),
            ],
        }
    }
}

/// The program that serves a disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    Vdisk,
    /// `qemu-storage-daemon` with the qcow2 driver on a file node and a vhost-user-blk
    /// export: QEMU's own way of serving a disk to a VM from another process.
    QemuStorageDaemon,
}

impl Server {
    pub fn name(self) -> &'static str {
        match self {
            Server::Vdisk => "vdisk serve",
            Server::QemuStorageDaemon => "qemu-storage-daemon",
        }
    }
}

/// An image to export, and everything needed to (re)start the server that exports it.
#[derive(Clone, Debug)]
pub struct Export {
    pub name: String,
    pub server: Server,
    pub image: PathBuf,
    /// The virtual size, which the guest checks its disk against.
    pub size: u64,
    pub disk: Disk,
    /// Where the socket, pid file and log go.
    dir: PathBuf,
}

impl Export {
    /// `image` (a qcow2 file of virtual size `size`) exported over `transport`, with its
    /// files in `dir` named after `name`.
    pub fn new(dir: &Path, name: &str, image: &Path, size: u64, transport: Transport) -> Export {
        Export {
            name: name.to_string(),
            server: Server::Vdisk,
            image: image.to_path_buf(),
            size,
            disk: Disk::new(transport, dir.join(format!("{name}.sock"))),
            dir: dir.to_path_buf(),
        }
    }

    /// The same export, served by `server`.
    pub fn served_by(mut self, server: Server) -> Export {
        self.server = server;
        self
    }

    /// The command that serves the image and writes `pid_file` once it listens.
    fn command(&self, peers: &Peers, pid_file: &Path) -> Command {
        match (self.server, &self.disk) {
            (Server::Vdisk, _) => {
                let mut cmd = Command::new(&peers.vdisk);
                cmd.arg("serve")
                    .args(["-f", "qcow2"])
                    .arg(&self.image)
                    .args(self.disk.serve_args())
                    .arg("--pid-file")
                    .arg(pid_file);
                cmd
            }
            (Server::QemuStorageDaemon, Disk::VhostUserBlk { socket, num_queues }) => {
                let mut cmd = Command::new(&peers.qemu_storage_daemon);
                // QEMU's option syntax doubles a comma inside a value.
                let image = self.image.display().to_string().replace(',', ",,");
                let socket = socket.display().to_string().replace(',', ",,");
                // discard=unmap: QEMU ignores the guest's discards otherwise.
                cmd.arg("--blockdev")
                    .arg(format!(
                        "driver=file,node-name=file,filename={image},discard=unmap"
                    ))
                    .args([
                        "--blockdev",
                        "driver=qcow2,node-name=fmt,file=file,discard=unmap",
                    ])
                    .arg("--export")
                    .arg(format!(
                        "type=vhost-user-blk,id=exp,node-name=fmt,addr.type=unix,\
                         addr.path={socket},writable=on,num-queues={num_queues}"
                    ))
                    .arg("--pidfile")
                    .arg(pid_file);
                cmd
            }
            (Server::QemuStorageDaemon, Disk::Nbd { .. }) => {
                unreachable!("the VM tests compare with qemu-storage-daemon over vhost-user-blk")
            }
        }
    }

    /// Starts the server and waits until it listens (its pid file appears). A restart after a
    /// kill reuses the socket path the killed server left behind.
    pub fn serve(&self, peers: &Peers) -> Served {
        let pid_file = self.dir.join(format!("{}.pid", self.name));
        let log = self.dir.join(format!("{}.log", self.name));
        let _ = fs::remove_file(&pid_file);
        let child = self
            .command(peers, &pid_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Appended to, so that a restarted server's log follows the killed one's.
            .stderr(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.server.name()));
        let mut s = Served {
            child: Some(child),
            export: self.clone(),
            pid_file,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !s.pid_file.exists() {
            if let Some(status) = s.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "{} {} exited early ({status}):\n{}",
                    self.server.name(),
                    self.name,
                    s.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} {} did not start:\n{}",
                self.server.name(),
                self.name,
                s.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }
}

/// A server process exporting one image; killed if still running when dropped.
pub struct Served {
    child: Option<Child>,
    pub export: Export,
    pid_file: PathBuf,
    log: PathBuf,
}

impl Served {
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What a guest's failure report says about this server (see [`Watch`]).
    pub fn watch(&self) -> Watch {
        Watch {
            server: self.export.server,
            name: self.export.name.clone(),
            pid: self.child.as_ref().map_or(0, |c| c.id()),
            pid_file: self.pid_file.clone(),
            log: self.log.clone(),
        }
    }

    /// SIGTERM (flush, close the image clean), and insists on a clean exit within 60 s.
    pub fn stop(mut self) {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of a child that has not been reaped yet.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{} did not stop within 60 s of SIGTERM:\n{}",
                    self.export.server.name(),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            status.success(),
            "{} exited with {status}:\n{}",
            self.export.server.name(),
            self.log()
        );
        assert!(
            !self.pid_file.exists(),
            "{} left its pid file behind",
            self.export.server.name()
        );
    }

    /// SIGKILL: the server dies with whatever it had not written yet.
    pub fn kill(mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL to the server");
        child.wait().unwrap();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A server as a guest's failure report describes it: whether it still runs (a guest whose
/// vhost-user back end died waits for it forever, so a timeout may be the server's doing) and
/// what it logged.
#[derive(Clone, Debug)]
pub struct Watch {
    server: Server,
    name: String,
    pid: u32,
    pid_file: PathBuf,
    log: PathBuf,
}

impl Watch {
    pub fn describe(&self) -> String {
        // A child that exited stays a zombie ("Z") until the test reaps it.
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        let state = match stat.rsplit(") ").next().and_then(|r| r.chars().next()) {
            Some('Z') | None => "has exited",
            Some(_) => "is running",
        };
        // Both servers remove their pid file when they exit clean (SIGTERM, SIGINT).
        let pid_file = if self.pid_file.exists() {
            "present"
        } else {
            "gone"
        };
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        let from = log.lines().count().saturating_sub(20);
        let tail: Vec<&str> = log.lines().skip(from).collect();
        format!(
            "{} {} (pid {}) {state}, pid file {pid_file}; its log ends:\n{}\n",
            self.server.name(),
            self.name,
            self.pid,
            tail.join("\n")
        )
    }
}
