//! QEMU's image locks (block/file-posix.c), so that vdisk and QEMU keep each other from
//! writing an image another process uses. Each block permission `p` has two bytes in the file:
//! `100 + p`, read-locked by every holder of `p`, and `200 + p`, read-locked by everyone who
//! does not let others hold `p`. The locks are OFD locks: they belong to the open descriptor
//! and go away when it is closed. A conflict is a byte another descriptor has locked, found by
//! testing it with a write lock.
//!
//! vdisk takes the locks QEMU's own processes take (read off `/proc/locks` beside `qemu-io`,
//! `qemu-nbd` and `qemu-img`), by what the file is to the image ([`LockRole`]):
//!
//! | file               | reader: held / not shared | writer: held / not shared           |
//! | ------------------ | ------------------------- | ----------------------------------- |
//! | a qcow2 image      | read / write, resize      | read, write, resize / write, resize |
//! | a raw image        | read / none               | read, write (+resize) / none        |
//! | a qcow2's data file | read / resize            | read, write, resize / resize        |
//!
//! Backing files are read. An NBD export also keeps others from resizing its image (`fixed`):
//! its size is fixed for its clients. With `-U` (force-share) a reader takes no locks at all.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;

const PERM_BASE: i64 = 100;
const SHARED_BASE: i64 = 200;

/// Permissions by bit number and QEMU's name for them.
const READ: (i64, &str) = (0, "consistent read");
const WRITE: (i64, &str) = (1, "write");
const RESIZE: (i64, &str) = (3, "resize");

fn lock_op(file: &File, cmd: libc::c_int, kind: libc::c_int, byte: i64) -> io::Result<bool> {
    // SAFETY: flock is plain data; all-zero is a valid value that the fields below complete.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    // SAFETY: fcntl reads and (for F_OFD_GETLK) fills in `fl`, which lives across the call;
    // the descriptor is owned by `file`.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type == libc::F_UNLCK as libc::c_short)
}

/// What a file is to the image that opens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockRole {
    /// An image whose format keeps metadata in the file (qcow2, seqlog).
    Format,
    Raw,
    DataFile,
}

/// How a process uses a file: read or written, resized by it, or of a size others must not
/// change.
#[derive(Debug, Clone, Copy, Default)]
pub struct LockUse {
    pub write: bool,
    pub resize: bool,
    pub fixed: bool,
}

impl LockUse {
    /// A plain writer.
    pub const WRITER: LockUse = LockUse {
        write: true,
        resize: false,
        fixed: false,
    };
}

/// Takes the locks of `file` (at `path`, in `role`) for `usage`, or fails as QEMU does when
/// another process uses the file in a way this use excludes. File systems without OFD locks
/// are used without them, as QEMU does.
pub fn lock(file: &File, path: &Path, role: LockRole, usage: LockUse) -> io::Result<()> {
    let mut held = vec![READ];
    if usage.write {
        held.push(WRITE);
        if usage.resize || role != LockRole::Raw {
            held.push(RESIZE);
        }
    }
    let unshared: &[_] = match role {
        LockRole::Format => &[WRITE, RESIZE],
        LockRole::Raw if !usage.fixed => &[],
        LockRole::Raw | LockRole::DataFile => &[RESIZE],
    };
    let bytes = held.iter().map(|(p, _)| PERM_BASE + p);
    for byte in bytes.chain(unshared.iter().map(|(p, _)| SHARED_BASE + p)) {
        match lock_op(file, libc::F_OFD_SETLK, libc::F_RDLCK, byte) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
                return Err(conflict(path, "write", false))
            }
            Err(_) => return Ok(()),
        }
    }
    let free = |byte| lock_op(file, libc::F_OFD_GETLK, libc::F_WRLCK, byte);
    for &(p, name) in &held {
        if !free(SHARED_BASE + p)? {
            return Err(conflict(path, name, false));
        }
    }
    for &(p, name) in unshared {
        if !free(PERM_BASE + p)? {
            return Err(conflict(path, name, true));
        }
    }
    Ok(())
}

fn conflict(path: &Path, perm: &str, shared: bool) -> io::Error {
    let shared = if shared { "shared " } else { "" };
    io::Error::new(
        io::ErrorKind::WouldBlock,
        format!(
            "Failed to get {shared}\"{perm}\" lock\nIs another process using the image [{}]?",
            path.display()
        ),
    )
}
