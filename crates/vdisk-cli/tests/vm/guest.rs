//! Running a guest: a scenario's script goes into the initramfs (init.sh runs it), QEMU boots
//! the kit under TCG with the served disks attached, and the script's results come back on the
//! serial console, which is QEMU's stdout.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::cpio::Cpio;
use super::disk::{Served, Watch};
use super::kit::Kit;
use super::pattern::{Fill, Layout};

/// How long one QEMU run may take, boot to power-off: the runs take seconds to tens of seconds
/// (TCG, two at once on two cores); a hang ends here with the console in the failure.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// Guest memory; also the size of the shared memory vhost-user back ends map.
const MEMORY_MIB: u32 = 512;

/// A scenario's shell script (run by init.sh with its helpers `step`, `value` and `mark`),
/// and the steps the host expects to see succeed, in order.
#[derive(Default)]
pub struct Script {
    text: String,
    steps: Vec<String>,
    /// The guest may reboot: QEMU resets the machine instead of exiting.
    reboots: bool,
}

impl Script {
    pub fn new() -> Script {
        Script::default()
    }

    /// Lets the guest reboot within the run (`reboot -f`); it boots the same initramfs
    /// again, so the script must tell its boots apart (by what it left on a disk).
    pub fn rebooting(&mut self) -> &mut Script {
        self.reboots = true;
        self
    }

    fn named(&mut self, helper: &str, name: &str, command: &str) -> &mut Script {
        assert!(
            !name.is_empty() && !name.contains(char::is_whitespace),
            "step name {name:?}"
        );
        assert!(!self.steps.iter().any(|s| s == name), "step {name} twice");
        self.text += &format!("{helper} {name} {command}\n");
        self.steps.push(name.to_string());
        self
    }

    /// `command` (shell words; `sh -c '...'` for pipes) must succeed.
    pub fn step(&mut self, name: &str, command: &str) -> &mut Script {
        self.named("step", name, command)
    }

    /// A step whose last line of output the host reads with [`Console::value`].
    pub fn value(&mut self, name: &str, command: &str) -> &mut Script {
        self.named("value", name, command)
    }

    /// A point the host waits for with [`Vm::wait_for_mark`].
    pub fn mark(&mut self, name: &str) -> &mut Script {
        self.text += &format!("mark {name}\n");
        self
    }

    /// Shell text run as it is, whose outcome the host does not check (a loop that runs until
    /// the host kills the guest, say).
    pub fn raw(&mut self, text: &str) -> &mut Script {
        self.text += text;
        self.text += "\n";
        self
    }
}

/// A running QEMU; killed if still running when dropped.
pub struct Vm {
    child: Option<Child>,
    name: String,
    lines: Receiver<String>,
    console: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
    stderr: PathBuf,
    servers: Vec<Watch>,
    deadline: Instant,
}

impl Vm {
    /// Boots the kit with `disks` as vda, vdb, ... and `script` as the scenario, which first
    /// checks that each disk is there with the size of its image and its virtqueues.
    pub fn boot(kit: &Kit, dir: &Path, name: &str, disks: &[&Served], script: &Script) -> Vm {
        let mut full = Script::new();
        full.step("disks-appear", &format!("wait_disks {}", disks.len()));
        for (i, d) in disks.iter().enumerate() {
            let dev = format!("vd{}", char::from(b'a' + i as u8));
            let sectors = d.export.size / 512;
            full.step(
                &format!("size-{dev}"),
                &format!("test \"$(cat /sys/block/{dev}/size)\" = {sectors}"),
            );
            full.step(
                &format!("queues-{dev}"),
                &format!(
                    "test \"$(ls /sys/block/{dev}/mq | wc -l)\" = {}",
                    d.export.disk.queues()
                ),
            );
        }
        full.text += &script.text;
        full.steps.extend(script.steps.iter().cloned());

        // Linux unpacks one archive after the other: the kit's, then the scenario's.
        let mut scenario = Cpio::new();
        scenario.file("scenario.sh", 0o644, full.text.as_bytes());
        let initrd = dir.join(format!("{name}.initrd"));
        std::fs::write(&initrd, [&kit.initramfs[..], &scenario.finish()].concat()).unwrap();

        let shared = disks.iter().any(|d| d.export.disk.needs_shared_memory());
        let mut machine = "q35,accel=tcg".to_string();
        let mut cmd = Command::new(&kit.peers.qemu_system);
        if shared {
            // vhost-user back ends map guest memory, so it must be a shareable file.
            cmd.args([
                "-object",
                &format!("memory-backend-memfd,id=mem,size={MEMORY_MIB}M,share=on"),
            ]);
            machine += ",memory-backend=mem";
        }
        // A CPU per virtqueue, so that the guest's blk-mq puts each queue to use.
        let cpus = disks
            .iter()
            .map(|d| d.export.disk.queues())
            .max()
            .unwrap_or(1);
        let memory = format!("{MEMORY_MIB}M");
        cmd.args(["-nodefaults", "-machine", &machine, "-cpu", "max"])
            .args(["-smp", &cpus.to_string(), "-m", &memory])
            .args(["-display", "none", "-serial", "stdio"])
            .arg("-kernel")
            .arg(&kit.kernel)
            .arg("-initrd")
            .arg(&initrd)
            // panic=-1: a kernel panic reboots, which -no-reboot turns into QEMU exiting.
            .args(["-append", "console=ttyS0 panic=-1 quiet"]);
        if !script.reboots {
            cmd.arg("-no-reboot");
        }
        for (i, d) in disks.iter().enumerate() {
            cmd.args(d.export.disk.qemu_args(i));
        }
        let stderr = dir.join(format!("{name}.qemu-stderr"));
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("starting qemu-system-x86_64");

        let (tx, lines) = mpsc::channel();
        let console = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let kept = console.clone();
        let reader = std::thread::spawn(move || {
            let mut out = BufReader::new(out);
            let mut buf = Vec::new();
            while out.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
                let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                kept.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
                buf.clear();
            }
        });
        Vm {
            child: Some(child),
            name: name.to_string(),
            lines,
            console,
            reader: Some(reader),
            stderr,
            servers: disks.iter().map(|d| d.watch()).collect(),
            deadline: Instant::now() + RUN_TIMEOUT,
        }
    }

    /// What the guest printed so far, and what QEMU did on its stderr.
    fn console(&self) -> Console {
        Console {
            name: self.name.clone(),
            lines: self.console.lock().unwrap().clone(),
            qemu_stderr: std::fs::read_to_string(&self.stderr).unwrap_or_default(),
            servers: self.servers.iter().map(Watch::describe).collect(),
        }
    }

    /// `why`, then the console's last lines, for a failure message.
    fn report(&self, why: &str) -> String {
        format!("{why}\n{}", self.console().tail(60))
    }

    /// Waits until the guest reports `VMTEST MARK name`.
    #[track_caller]
    pub fn wait_for_mark(&mut self, name: &str) {
        let want = format!("VMTEST MARK {name}");
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(&want) => return,
                Ok(l) if l.contains("VMTEST FAIL") || l.contains("VMTEST DONE") => {
                    panic!(
                        "{}",
                        self.report(&format!("{}: ended before {want}", self.name))
                    )
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    self.stop_qemu();
                    panic!(
                        "{}",
                        self.report(&format!("{}: no {want} within {RUN_TIMEOUT:?}", self.name))
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "{}",
                        self.report(&format!("{}: QEMU exited before {want}", self.name))
                    )
                }
            }
        }
    }

    fn stop_qemu(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
            // Kept with the scenario's directory (VM_TEST_KEEP=1), for a look at a passing run.
            let lines = self.console.lock().unwrap().join("\n");
            let _ = std::fs::write(self.stderr.with_extension("console"), lines + "\n");
        }
    }

    /// Waits for the guest to power off; returns its console.
    #[track_caller]
    pub fn finish(mut self) -> Console {
        let child = self.child.as_mut().unwrap();
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > self.deadline {
                self.stop_qemu();
                panic!(
                    "{}",
                    self.report(&format!(
                        "{}: still running after {RUN_TIMEOUT:?}",
                        self.name
                    ))
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop_qemu();
        self.console()
    }

    /// Kills QEMU (the guest gets no chance to write anything more).
    pub fn kill(mut self) {
        self.stop_qemu();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop_qemu();
    }
}

/// What a guest printed on its serial console.
pub struct Console {
    name: String,
    lines: Vec<String>,
    /// Where QEMU says why it could not start or attach a disk.
    qemu_stderr: String,
    /// The state of the disks' servers when the guest stopped (see [`Watch`]).
    servers: String,
}

impl Console {
    /// The last `n` lines, under a heading, then QEMU's stderr if it said anything, and the
    /// servers' state.
    pub fn tail(&self, n: usize) -> String {
        let from = self.lines.len().saturating_sub(n);
        let mut s = format!(
            "--- last {} lines of {}'s console ---\n",
            self.lines.len() - from,
            self.name
        );
        for l in &self.lines[from..] {
            s += l;
            s += "\n";
        }
        if !self.qemu_stderr.is_empty() {
            s += &format!("--- QEMU's stderr ---\n{}", self.qemu_stderr);
        }
        s + "--- servers ---\n" + &self.servers + "---"
    }

    /// Every step of `script` succeeded, in order, and the script ran to its end.
    #[track_caller]
    pub fn expect(&self, script: &Script) {
        let ok: Vec<&str> = self
            .lines
            .iter()
            .filter_map(|l| Some(l[l.find("VMTEST OK ")? + 10..].trim()))
            .collect();
        let mut rest = ok.iter();
        let why = if let Some(f) = self.lines.iter().find(|l| l.contains("VMTEST FAIL")) {
            format!("a step failed: {f}")
        } else if let Some(step) = script.steps.iter().find(|s| !rest.any(|o| o == s)) {
            format!("step {step} did not report OK (in order)")
        } else if !self.lines.iter().any(|l| l.contains("VMTEST DONE")) {
            "the scenario did not run to its end".to_string()
        } else {
            return;
        };
        panic!("{}: {why}\n{}", self.name, self.tail(60));
    }

    /// The value the step `name` reported (see [`Script::value`]).
    #[track_caller]
    pub fn value(&self, name: &str) -> String {
        let want = format!("VMTEST VALUE {name} ");
        let found = self
            .lines
            .iter()
            .find_map(|l| Some(l[l.find(&want)? + want.len()..].to_string()));
        match found {
            Some(v) => v,
            None => panic!("{}: no value {name}\n{}", self.name, self.tail(60)),
        }
    }
}

/// Writing and checking [`Layout`]s with `vmio`, one step per range.
impl Script {
    /// Writes the pattern runs of `layout` into `path` (a file, created, or a device), with
    /// O_DIRECT if `direct`. Zeroed ranges (BLKZEROOUT, discards) are the scenario's own steps.
    pub fn write_layout(
        &mut self,
        name: &str,
        path: &str,
        layout: &Layout,
        direct: bool,
    ) -> &mut Script {
        let d = if direct { " -d" } else { "" };
        for (i, &(off, len, fill)) in layout.runs.iter().enumerate() {
            let Fill::Pattern(seed) = fill else {
                panic!("{name}: zeros are the scenario's own steps (BLKZEROOUT, discard)");
            };
            self.step(
                &format!("{name}-w{i}"),
                &format!("vmio write{d} {path} {seed} {off} {len}"),
            );
        }
        self
    }

    /// Checks every range of `layout` in `path` (zeros included), with O_DIRECT if `direct`;
    /// `tag` keeps the step names of several checks apart.
    pub fn check_layout(
        &mut self,
        name: &str,
        tag: &str,
        path: &str,
        layout: &Layout,
        direct: bool,
    ) -> &mut Script {
        let d = if direct { " -d" } else { "" };
        for (i, (off, len, fill)) in layout.segments().into_iter().enumerate() {
            let command = match fill {
                Fill::Pattern(seed) => format!("vmio check{d} {path} {seed} {off} {len}"),
                Fill::Zero => format!("vmio zeros{d} {path} {off} {len}"),
            };
            self.step(&format!("{name}-{tag}{i}"), &command);
        }
        self
    }

    /// [`Script::check_layout`] for a file, which must also end where `layout` does.
    pub fn check_file(
        &mut self,
        name: &str,
        tag: &str,
        path: &str,
        layout: &Layout,
        direct: bool,
    ) -> &mut Script {
        self.check_layout(name, tag, path, layout, direct).step(
            &format!("{name}-{tag}size"),
            &format!("test \"$(stat -c %s {path})\" = {}", layout.len),
        )
    }
}
