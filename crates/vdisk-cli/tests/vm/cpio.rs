//! The cpio "newc" archives a guest's initramfs is made of, written here so that building one
//! needs neither root nor a `cpio` binary (device nodes are only headers). Linux unpacks
//! archives that follow one another, so a scenario's script travels as a small archive appended
//! to the kit's.

/// An archive being built, entries in the order added (a directory before what it holds).
#[derive(Default)]
pub struct Cpio {
    out: Vec<u8>,
    inode: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl Cpio {
    pub fn new() -> Cpio {
        Cpio::default()
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        let name = name.trim_start_matches('/');
        assert!(!name.is_empty(), "an entry needs a name");
        self.inode += 1;
        let nlink = if mode & S_IFDIR != 0 { 2 } else { 1 };
        // c_ino c_mode c_uid c_gid c_nlink c_mtime c_filesize c_devmajor c_devminor
        // c_rdevmajor c_rdevminor c_namesize c_check, each eight hex digits.
        let fields = [
            self.inode,
            mode,
            0,
            0,
            nlink,
            0,
            u32::try_from(data.len()).expect("a file under 4 GiB"),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    /// The header and the name, then the data, each start at a multiple of 4.
    fn pad(&mut self) {
        while self.out.len() % 4 != 0 {
            self.out.push(0);
        }
    }

    pub fn dir(&mut self, name: &str) {
        self.entry(name, S_IFDIR | 0o755, (0, 0), &[]);
    }

    /// A file with permission bits `perm` (0o755 for programs).
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, S_IFREG | perm, (0, 0), data);
    }

    pub fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, S_IFCHR | 0o600, (major, minor), &[]);
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.out
    }
}

#[test]
fn entries_are_aligned_and_end_with_the_trailer() {
    let mut c = Cpio::new();
    c.dir("/bin");
    c.file("bin/x", 0o755, b"abcde");
    let out = c.finish();
    assert_eq!(&out[..6], b"070701");
    // The first header: inode 1, a directory, name "bin" (4 bytes with the NUL).
    assert_eq!(&out[6..22], b"00000001000041ed");
    assert_eq!(&out[94..102], b"00000004");
    assert_eq!(&out[110..114], b"bin\0");
    // A 110-byte header and a 4-byte name: the file's header follows at 116, padded to 4.
    assert_eq!(&out[116..122], b"070701");
    assert_eq!(&out[116 + 54..116 + 62], b"00000005", "file size");
    // "bin/x\0" (6 bytes) ends at 232, padded to 232; the data, 5 bytes, to 240.
    assert_eq!(&out[232..237], b"abcde");
    assert_eq!(&out[240..246], b"070701");
    assert!(out.len() % 4 == 0);
    assert!(out.windows(10).any(|w| w == b"TRAILER!!!"));
}
